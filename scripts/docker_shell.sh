#!/usr/bin/env bash
# RUNNER=docker: make's SHELL. Runs one recipe line inside the reprotune image instead of on the host:
#   scripts/docker_shell.sh -eu -o pipefail -c '<recipe line>'
# The repository is mounted at /workspace and the image's locked environment (/opt/venv) runs it. Secrets pass by
# name only (-e HF_TOKEN: docker reads the value from this environment; it never appears in a command line, a
# layer, a log or a manifest). The image's id goes into the run manifest (REPROTUNE_IMAGE_DIGEST).
set -euo pipefail

DOCKER=${DOCKER:-docker}
repo=${REPROTUNE_REPO:-$PWD}
variant=${DOCKER_VARIANT:-cpu}
image=${REPROTUNE_IMAGE:-reprotune:$variant}
MIN_DRIVER=580   # CUDA 13.0 (PyPI torch 2.13) needs an R580+ driver
die() { echo "RUNNER=docker: $*" >&2; exit 2; }

# The driver first: a CUDA 13 image on an older driver fails later with an obscure CUDA error.
gpus=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if [ "$variant" = cuda ]; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
    [ "${driver%%.*}" -ge "$MIN_DRIVER" ] 2>/dev/null \
      || die "host NVIDIA driver $driver is too old for $image (CUDA 13.0 needs driver >= $MIN_DRIVER); update the driver"
  fi
  gpus=(--gpus all)
elif [ "$variant" = cuda ]; then
  echo "RUNNER=docker: no NVIDIA GPU on this host; $image runs on the CPU" >&2
fi
command -v "$DOCKER" >/dev/null 2>&1 || die "no docker client ($DOCKER); install Docker or run without RUNNER=docker"
"$DOCKER" info >/dev/null 2>&1 || die "no Docker engine reachable (DOCKER_HOST=${DOCKER_HOST:-default}); start one (e.g. eval \"\$(bash scripts/docker_engine.sh start)\")"
"$DOCKER" image inspect "$image" >/dev/null 2>&1 || die "no image $image; build it: make docker-build VARIANT=$variant"

# The image must hold the environment this checkout's lock describes, or the run would not be what the lock says.
label() { "$DOCKER" image inspect -f "{{index .Config.Labels \"$1\"}}" "$image"; }
want=$(cat "$repo/lockfiles/$variant.txt" "$repo/lockfiles/builtin-model.txt" | sha256sum | cut -d' ' -f1)
have=$(label io.reprotune.lock.sha256)
[ "$have" = "$want" ] || die "$image was built from another lock (image $have, checkout lockfiles/$variant.txt $want): run make docker-build VARIANT=$variant"

run=(run --rm --init --shm-size="${DOCKER_SHM_SIZE:-8g}" -v "$repo:/workspace" -w /workspace)
# git worktrees keep their object store elsewhere: mount it read-only at the same path so git (and DVC) work
common=$(git -C "$repo" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
case "$common" in "" | "$repo/.git") ;; *) run+=(-v "$common:$common:ro") ;; esac
# Outputs on the mount belong to whoever runs make (the image's own user is uid 1000, for pods)
uid=$(id -u); gid=$(id -g)
run+=(--user "$uid:$gid" "${gpus[@]}")
[ "$uid" = 0 ] || [ "$uid" = 1000 ] || run+=(-e HOME=/tmp)


# What make exported (seeds, thread settings, offline switches) and the user's HF_/WANDB_/REPROTUNE_ settings,
# all by name. Host paths are not forwarded: in the container the caches live under /workspace/.cache.
for name in $(compgen -e); do
  case "$name" in
    REPROTUNE_CACHE | REPROTUNE_CONF | REPROTUNE_REPO | REPROTUNE_IMAGE | HF_HOME) ;;
    REPROTUNE_* | HF_* | HUGGING_FACE_* | WANDB_* | OPENAI_* | AWS_* | CUDA_VISIBLE_DEVICES | PYTHONHASHSEED \
      | TOKENIZERS_PARALLELISM | DO_NOT_TRACK | OMP_NUM_THREADS | MKL_NUM_THREADS | ARGS) run+=(-e "$name") ;;
  esac
done
image_ref=$("$DOCKER" image inspect -f '{{range .RepoDigests}}{{.}} {{end}}' "$image" | awk '{print $1}')
run+=(-e PYTHONPATH=/workspace/src -e REPROTUNE_IMAGE_DIGEST="${image_ref:-$("$DOCKER" image inspect -f '{{.Id}}' "$image")}")
# shellcheck disable=SC2086  # DOCKER_RUN_FLAGS is a list of flags (e.g. --network=none)
# bash directly, not the image's entrypoint: it runs as --user already, with nothing to hand over or drop
exec "$DOCKER" "${run[@]}" ${DOCKER_RUN_FLAGS:-} --entrypoint /bin/bash "$image" "$@"
