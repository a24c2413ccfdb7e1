"""The image: lint and digest pins (always), then, with a Docker engine: build the CPU image, run the smoke train in
it with no network, check labels and secrets, and rebuild it to prove the installed environment is byte-identical.

CI gets an engine from scripts/docker_engine.sh (.ci/run). Without one the engine tests are skipped, with the reason.
The image builds FROM the pinned base, or FROM $REPROTUNE_DOCKER_BASE where no registry is reachable (CI).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker/Dockerfile"
IMAGE = os.environ.get("REPROTUNE_TEST_IMAGE", "reprotune:cpu-test")
CANARY = "reprotune-secret-canary-7f3a"  # appended to the CA bundle secret and used as HF_TOKEN; must never persist


def docker_client() -> str:
    if os.environ.get("DOCKER"):
        return os.environ["DOCKER"]
    # Debian's 20.10 client builds with its builtin BuildKit; a newer client without buildx cannot build
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


@functools.cache
def engine_problem() -> str | None:
    docker = docker_client()
    if not shutil.which(docker):
        return f"no docker client ({docker})"
    try:
        info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if info.returncode != 0:
        return f"no Docker engine reachable (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'default')})"
    return None


needs_engine = pytest.mark.skipif(bool(engine_problem()), reason=f"Docker image checks: {engine_problem()}; "
                                  "run .ci/run or 'eval \"$(bash scripts/docker_engine.sh start)\"' first")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else "hadolint"


# ---- static checks (no engine) ------------------------------------------------------------------------------------

def test_hadolint_clean() -> None:
    out = run([hadolint(), "--config", str(REPO / ".hadolint.yaml"), str(DOCKERFILE)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_from_is_digest_pinned() -> None:
    out = run([sys.executable, "scripts/check_dockerfile_pins.py", str(DOCKERFILE)], cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = DOCKERFILE.read_text().splitlines()
    assert not any(re.match(r"#\s*syntax\s*=", line) for line in lines), "a syntax directive pulls from Docker Hub"
    code = [line for line in lines if not line.lstrip().startswith("#")]
    assert not any("<<" in line or "--link" in line for line in code), \
        "Docker 20.10's builtin frontend has no heredocs or COPY --link"


@pytest.mark.parametrize("dockerfile, message", [
    ("FROM axolotlai/axolotl-cloud:main-latest\n", "Dockerfile:1: FROM axolotlai/axolotl-cloud:main-latest: not pinned"),
    ("FROM debian@sha256:" + "a" * 64 + "\n", "not pinned by tag and digest"),
    ("ARG BASE=debian:12\nFROM ${BASE} AS os\nFROM os\n", "Dockerfile:2: FROM debian:12: not pinned"),
    ("ARG BASE\nFROM $BASE\n", "Dockerfile:2: FROM $BASE: the ARG has no default image"),
    ("FROM debian:12@sha256:" + "a" * 64 + " AS a\nRUN true\nFROM \\\n  python:3.11\n", "Dockerfile:3: FROM python:3.11"),
])
def test_pin_check_rejects(tmp_path: Path, dockerfile: str, message: str) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text(dockerfile)
    out = run([sys.executable, str(REPO / "scripts/check_dockerfile_pins.py"), str(path)], cwd=tmp_path)
    assert out.returncode == 1
    assert message in out.stderr


def test_pin_check_accepts_stage_references(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text("ARG B=docker.io/library/debian:12.12-slim@sha256:" + "0" * 64 + "\nFROM ${B} AS os\n"
                    "FROM os AS env\nFROM env\n")
    out = run([sys.executable, str(REPO / "scripts/check_dockerfile_pins.py"), str(path)])
    assert out.returncode == 0, out.stderr


def test_runner_docker_runs_recipes_with_the_image_env() -> None:
    out = run(["make", "-n", "train", "RUNNER=docker", "VARIANT=cpu"], cwd=REPO)
    assert out.returncode == 0, out.stderr
    # the runner composes params.yaml and runs the dvc next to its python (/opt/venv/bin/dvc repro train)
    assert "exec /opt/venv/bin/python -m reprotune.runner train" in out.stdout
    assert ".venv/bin" not in out.stdout
    bad = run(["make", "-n", "train", "RUNNER=podman"], cwd=REPO)
    assert bad.returncode != 0 and "RUNNER=podman: use RUNNER=local" in bad.stderr


def test_runner_docker_explains_a_missing_engine(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER": str(tmp_path / "no-such-docker")}
    out = run(["make", "prepare", "RUNNER=docker", "VARIANT=cpu"], cwd=REPO, env=env)
    assert out.returncode != 0
    assert "RUNNER=docker: no docker client" in out.stderr
    assert "Traceback" not in out.stderr


def test_runner_docker_refuses_an_old_driver(tmp_path: Path) -> None:
    """Before any container starts: a CUDA 13 image on a driver older than R580 stops with the reason."""
    fake = tmp_path / "bin/nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$*" in *query-gpu*) echo 550.54.15 ;; *) echo "GPU 0: Fake (UUID: GPU-0)" ;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "DOCKER": "/bin/false"}
    out = run(["make", "prepare", "RUNNER=docker", "VARIANT=cuda"], cwd=REPO, env=env)
    assert out.returncode != 0
    assert "host NVIDIA driver 550.54.15 is too old for reprotune:cuda (CUDA 13.0 needs driver >= 580)" in out.stderr


# ---- the image (needs an engine) ----------------------------------------------------------------------------------

def build(tag: str, *flags: str, ca_bundle: Path, variant: str = "cpu", llama_cpp: str = "1"
          ) -> subprocess.CompletedProcess[str]:
    # llama.cpp's tools are built in (reusing the host's identical build from make test's llama-cpp step)
    env = {**os.environ, "VARIANT": variant, "REPROTUNE_IMAGE": tag, "DOCKER": docker_client(), "LLAMA_CPP": llama_cpp,
           "CA_BUNDLE": str(ca_bundle), "DOCKER_BUILD_FLAGS": " ".join(["--progress=plain", *flags])}
    return run(["bash", "scripts/docker_build.sh"], cwd=REPO, env=env, timeout=1800)


@pytest.fixture(scope="module")
def ca_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host's CA bundle (TLS-intercepting egress needs it) plus a canary line that must never reach a layer."""
    host = Path(os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    bundle = tmp_path_factory.mktemp("ca") / "cabundle.pem"
    bundle.write_text((host.read_text() if host.is_file() else "") + f"\n# {CANARY}\n")
    return bundle


@pytest.fixture(scope="module")
def image(ca_bundle: Path) -> dict:
    out = build(IMAGE, ca_bundle=ca_bundle)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    inspect = run([docker_client(), "image", "inspect", IMAGE])
    assert inspect.returncode == 0, inspect.stderr
    return json.loads(inspect.stdout)[0]


def in_image(*cmd: str, flags: tuple[str, ...] = ("--network=none",)) -> subprocess.CompletedProcess[str]:
    return run([docker_client(), "run", "--rm", *flags, IMAGE, *cmd], timeout=600)


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_image_config(image: dict) -> None:
    config = image["Config"]
    labels = config["Labels"]
    head = run(["git", "rev-parse", "HEAD"], cwd=REPO).stdout.strip()
    assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == head
    lock = (REPO / "lockfiles/cpu.txt").read_bytes() + (REPO / "lockfiles/builtin-model.txt").read_bytes()
    import hashlib

    assert labels["io.reprotune.lock.sha256"] == hashlib.sha256(lock).hexdigest()
    assert labels["io.reprotune.variant"] == "cpu"
    assert config["Entrypoint"] == ["/usr/local/bin/reprotune-entrypoint"] and config["WorkingDir"] == "/workspace"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["HF_HOME"].startswith("/workspace/") and env["VENV"] == "/opt/venv"
    assert not any(k in env for k in ("HF_TOKEN", "WANDB_API_KEY", "PIP_CERT", "SSL_CERT_FILE"))
    whoami = in_image("bash", "-c", "id -u; python --version; python -c 'import torch, reprotune; "
                      "print(torch.__version__, reprotune.__file__)'; test ! -e /run/secrets/cabundle && echo nosecret")
    assert whoami.returncode == 0, whoami.stderr
    uid, python, versions, secret = whoami.stdout.split("\n")[:4]
    assert uid == "1000" and python.startswith("Python 3.11.")
    assert versions == "2.13.0+cpu /opt/reprotune/src/reprotune/__init__.py"
    assert secret == "nosecret"


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_pod_volume_owned_by_root_is_usable(image: dict, tmp_path: Path) -> None:
    """A pod: the provider mounts a root-owned volume at /workspace and starts the image's entrypoint as root."""
    volume = tmp_path / "volume"
    volume.mkdir()
    os.chmod(volume, 0o755)
    out = in_image("bash", "-c", "id -u && mkdir -p outputs/checkpoints && stat -c %u outputs/checkpoints",
                   flags=("--network=none", "--user", "0:0", "-v", f"{volume}:/workspace"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1000", "1000"]
    assert (volume / "outputs/checkpoints").stat().st_uid == 1000


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_ca_secret_never_reaches_a_layer(image: dict) -> None:
    """docker save streams every layer and the config: the canary in the CA secret must be in none of them."""
    save = subprocess.Popen([docker_client(), "save", IMAGE], stdout=subprocess.PIPE)
    needle, tail, found, size = CANARY.encode(), b"", False, 0
    assert save.stdout is not None
    while chunk := save.stdout.read(1 << 22):
        size += len(chunk)
        found = found or needle in tail + chunk
        tail = chunk[-len(needle):]
    assert save.wait() == 0 and size > 100_000_000
    assert not found, "the CA bundle secret was written into the image"


def workspace_copy(dest: Path) -> Path:
    """This checkout's files (tracked + untracked, not ignored) as a fresh git repository, as CI would clone it."""
    files = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).stdout.split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.email=ci@reprotune", "-c", "user.name=ci", "commit", "-qm", "ws"]):
        assert run(["git", *cmd], cwd=dest).returncode == 0
    return dest


def container_env() -> dict[str, str]:
    """make ... RUNNER=docker as a user would call it, with planted secrets and no network in the container."""
    env = {k: v for k, v in os.environ.items() if k not in ("REPROTUNE_CACHE", "PYTHONPATH", "LLAMA_CPP_CACHE")}
    env.update(DOCKER=docker_client(), HF_TOKEN=CANARY, WANDB_API_KEY=CANARY + "-wandb", REPROTUNE_IMAGE=IMAGE,
               DOCKER_RUN_FLAGS="--network=none")
    return env


def assert_no_secret(log: str, outputs: Path) -> None:
    for text in (log, *(p.read_text(errors="replace") for p in outputs.rglob("*.json"))):
        assert CANARY not in text, "a secret value reached a log or an output"
    # the tokens were passed by name: the command lines docker received held no value
    assert "HF_TOKEN=" not in log


@pytest.fixture(scope="module")
def smoke_run(image: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    ws = workspace_copy(tmp_path_factory.mktemp("smoke") / "ws")
    out = run(["make", "test-smoke", "RUNNER=docker", "VARIANT=cpu"], cwd=ws, env=container_env(), timeout=900)
    return ws, out


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_smoke_train_in_container_offline(image: dict, smoke_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    ws, out = smoke_run
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert (ws / "outputs/adapter/adapter_model.safetensors").is_file()
    manifest = json.loads((ws / "outputs/train/manifest.json").read_text())
    assert manifest["runtime"]["container_image"] == image["Id"]
    assert manifest["runtime"]["torch"] == "2.13.0+cpu"
    assert manifest["lock"]["sha256"] is not None and manifest["git"]["commit"] is not None
    assert_no_secret(log, ws / "outputs")


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_container_and_host_give_the_same_bytes(smoke_run: tuple[Path, subprocess.CompletedProcess[str]],
                                                tmp_path: Path) -> None:
    """The same checkout, the same lock, the same command on the host (this .venv) and in the image: the prepared
    data, every adapter file, the loss curve and its plot come out byte-identical (same CPU, same torch wheel).
    Only the manifests differ, by design: they record where each ran (host or image id, Python build)."""
    ws, smoke = smoke_run
    assert smoke.returncode == 0, (smoke.stdout + smoke.stderr)[-2000:]
    host = workspace_copy(tmp_path / "host")
    (host / ".venv").symlink_to(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("REPROTUNE_CACHE", "PYTHONPATH", "VENV")}
    out = run(["make", "test-smoke"], cwd=host, env=env, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]

    def files(root: Path) -> dict[Path, bytes]:
        return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and p.name != "manifest.json"}

    for tree in ("data/prepared", "outputs/adapter", "outputs/train"):
        mine, theirs = files(host / tree), files(ws / tree)
        assert mine.keys() == theirs.keys() and len(mine) >= 2, tree
        differ = [str(name) for name in mine if mine[name] != theirs[name]]
        assert not differ, f"{tree}: host and container differ in {differ}"


# the export tests' tiny settings (tests/export_pipeline.py): an adapter that moves the logits, one quant type.
# The workspace has no dvc.lock yet (test-smoke runs the modules directly), so DVC runs prepare and train first:
# 4 steps as in the smoke run, not train's default 50 (minutes of CPU that prove nothing more here)
EXPORT_ARGS = ("model=tiny_random train.max_steps=4 train.learning_rate=0.01 export.quant=[Q8_0] "
               "export.parity.examples=2 export.parity.max_new_tokens=8 export.merge.prompts=2")


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_merge_and_gguf_in_container_offline(image: dict, smoke_run: tuple[Path, subprocess.CompletedProcess[str]]
                                             ) -> None:
    """make merge gguf RUNNER=docker in the smoke workspace (DVC prepares and trains first, see EXPORT_ARGS): the
    image's own llama.cpp (built into /opt/llama.cpp, nothing compiled or downloaded at run time: --network=none)
    converts, quantizes and passes the parity checks."""
    ws, smoke = smoke_run
    assert smoke.returncode == 0, (smoke.stdout + smoke.stderr)[-2000:]
    out = run(["make", "merge", "gguf", "RUNNER=docker", "VARIANT=cpu", f"ARGS={EXPORT_ARGS}"], cwd=ws,
              env=container_env(), timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "compiling libllama" not in log and "installing llama_cpp_python" not in log
    gguf = ws / "outputs/gguf"
    assert sorted(p.name for p in gguf.iterdir()) == ["Modelfile", "imatrix.gguf", "model-F16.gguf", "model-Q8_0.gguf",
                                                      "parity.json"]
    assert (gguf / "model-Q8_0.gguf").read_bytes()[:4] == b"GGUF"
    assert json.loads((ws / "outputs/train/metrics.json").read_text())["global_step"] == 4
    manifest = json.loads((ws / "outputs/export/gguf_manifest.json").read_text())
    assert manifest["llama_cpp"]["llama_cpp_python"] == "0.3.36"
    assert manifest["runtime"]["container_image"] == image["Id"]
    assert_no_secret(log, ws / "outputs")


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_image_without_llama_cpp_says_so(image: dict, ca_bundle: Path, tmp_path: Path) -> None:
    """LLAMA_CPP=0 leaves llama.cpp out; make gguf in that image stops with the reason instead of compiling."""
    tag = IMAGE + "-nollama"
    out = build(tag, ca_bundle=ca_bundle, llama_cpp="0")  # the os/env layers are the cached ones of `image`
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    ws = workspace_copy(tmp_path / "ws")
    env = {**container_env(), "REPROTUNE_IMAGE": tag}
    out = run(["make", "llama-cpp", "RUNNER=docker", "VARIANT=cpu"], cwd=ws, env=env, timeout=300)
    run([docker_client(), "image", "rm", tag])
    assert out.returncode != 0
    assert "this image was built without llama.cpp's tools (LLAMA_CPP=0): rebuild it with llama.cpp" in out.stderr
    assert "compiling libllama" not in out.stderr


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_runner_docker_refuses_an_image_from_another_lock(image: dict, tmp_path: Path) -> None:
    ws = workspace_copy(tmp_path / "ws")
    with open(ws / "lockfiles/cpu.txt", "a") as fh:
        fh.write("# changed after the image was built\n")
    env = {**os.environ, "DOCKER": docker_client(), "REPROTUNE_IMAGE": IMAGE}
    out = run(["make", "prepare", "RUNNER=docker", "VARIANT=cpu"], cwd=ws, env=env, timeout=120)
    assert out.returncode != 0
    assert f"RUNNER=docker: {IMAGE} was built from another lock" in out.stderr
    assert not (ws / "data/prepared").exists()


def env_listing(tag: str) -> str:
    """sha256 of every file and symlink of the installed environment (/opt/venv, llama.cpp's /opt/llama.cpp), with
    modes, sorted."""
    script = ("import hashlib, os, stat, sys\n"
              "for root in ('/opt/venv', '/opt/llama.cpp'):\n"
              "    for d, dirs, files in os.walk(root):\n"
              "        dirs.sort()\n"
              "        for f in sorted(files):\n"
              "            p = os.path.join(d, f); st = os.lstat(p)\n"
              "            data = os.readlink(p).encode() if stat.S_ISLNK(st.st_mode) else open(p, 'rb').read()\n"
              "            print(oct(st.st_mode), hashlib.sha256(data).hexdigest(), p)\n")
    out = run([docker_client(), "run", "--rm", "--network=none", "--entrypoint", "/usr/bin/python3.11", tag, "-c",
               script], timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
def test_rebuild_is_byte_identical(image: dict, ca_bundle: Path) -> None:
    """--no-cache re-runs apt, the whole locked install and llama.cpp's install (pip's download cache is a cache
    mount, so only the downloads are reused; llama.cpp's compiled wheel is the host's same build, as in the first
    image): every installed byte must come out the same."""
    rebuilt = IMAGE + "-rebuild"
    # the first image's files are hashed while the second is built (a container of the finished image; the
    # build's own steps run in their own containers): the two overlap instead of adding up
    with ThreadPoolExecutor(max_workers=1) as pool:
        first_listing = pool.submit(env_listing, IMAGE)
        out = build(rebuilt, "--no-cache", ca_bundle=ca_bundle)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        first, second = first_listing.result(), env_listing(rebuilt)
    assert first.count("\n") > 10_000
    assert "/opt/venv/lib/python3.11/site-packages/llama_cpp/lib/libllama.so" in first
    assert "/opt/llama.cpp/" in first and "convert_hf_to_gguf.py" in first
    run([docker_client(), "image", "rm", rebuilt])
    diff = sorted(set(first.splitlines()) ^ set(second.splitlines()))
    assert not diff, f"{len(diff)} lines differ, e.g. {diff[:6]}"


@pytest.mark.slow
@pytest.mark.docker
@needs_engine
@pytest.mark.skipif(os.environ.get("REPROTUNE_DOCKER_CUDA") != "1",
                    reason="the CUDA image downloads ~2.9 GB of wheels: run with REPROTUNE_DOCKER_CUDA=1")
def test_cuda_image_builds(ca_bundle: Path) -> None:
    """The CUDA variant from the same Dockerfile: torch's CUDA 13 build and its hash-locked nvidia-* wheels.
    (No GPU here: this proves the image, not a GPU run; torch falls back to the CPU.)"""
    tag = "reprotune:cuda-test"
    out = build(tag, ca_bundle=ca_bundle, variant="cuda")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    labels = json.loads(run([docker_client(), "image", "inspect", tag]).stdout)[0]["Config"]["Labels"]
    assert labels["io.reprotune.variant"] == "cuda" and labels["io.reprotune.min-nvidia-driver"] == "580"
    probe = run([docker_client(), "run", "--rm", "--network=none", tag, "python", "-c",
                 "import torch, importlib.metadata as m; print(torch.__version__, torch.version.cuda, "
                 "m.version('nvidia-cudnn-cu13'), torch.cuda.is_available())"], timeout=600)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["2.13.0+cu130", "13.0", "9.20.0.48", "False"]
