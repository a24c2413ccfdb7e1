#!/bin/bash
# The image's entrypoint: run the command as the unprivileged user 'reprotune' (uid 1000), never as root.
# Pod volumes (RunPod, Vast.ai) are mounted at /workspace owned by root; started as root, hand that directory to
# uid 1000 first, then drop root for good (setpriv, util-linux). Started as another user (RUNNER=docker passes
# --user <you>, docker run --user ...), there is nothing to drop: run the command as is.
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  if [ -d /workspace ] && [ "$(stat -c %u /workspace)" != 1000 ]; then
    chown 1000:1000 /workspace || echo "entrypoint: cannot chown /workspace; uid 1000 may not be able to write it" >&2
  fi
  export HOME=/home/reprotune USER=reprotune LOGNAME=reprotune
  exec setpriv --reuid=1000 --regid=1000 --init-groups -- "$@"
fi
exec "$@"
