"""The DVC pipeline for real, in a throwaway git copy of this repository (tiny model, a few steps):

- `dvc exp run -S ...` (DVC composes conf/ with Hydra) and `make params ARGS=...` + `dvc repro` run the
  same thing: byte-identical adapters and the same resolved config;
- editing conf/ and re-running re-runs only the stages whose params changed;
- push to an SSH remote (a real sshd on 127.0.0.1 with a throwaway key), wipe cache and outputs, pull,
  and every hash matches; an older adapter version comes back by git revision;
- `make verify RUN=<git rev>` re-runs a committed revision with its own code and finds it identical.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from reprotune.manifest import sha256_tree

from .conftest import REPO

pytestmark = pytest.mark.slow  # runs the DVC pipeline several times, an sshd remote

VENV_BIN = Path(sys.executable).parent
SSHD = Path("/usr/sbin/sshd")
TINY = ["model=tiny_random", "train.max_steps=2", "train.save_steps=2", "train.logging_steps=1",
        "train.per_device_train_batch_size=2", "eval.max_examples=4", "eval.max_new_tokens=16"]
# what the tests run (up to eval); merge/gguf outputs were never produced here, so they are not pulled
RUN_STAGES = ["data.dvc", "prepare", "train", "eval"]
TIMINGS: dict[str, float] = {}


def sh(cmd: list[str], cwd: Path, env: dict, timeout: int = 900) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hashes(repo: Path) -> dict[str, str]:
    """sha256 of every DVC-managed file in the workspace (data, prepared data, adapter, manifests)."""
    out = {}
    for sub in ("data/raw", "data/prepared", "outputs/adapter"):
        out.update({f"{sub}/{k}": v for k, v in sha256_tree(repo / sub).items()})
    out.update({f"outputs/train/{k}": v for k, v in sha256_tree(repo / "outputs/train").items()})
    assert {"outputs/train/manifest.json", "outputs/train/metrics.json", "outputs/train/loss.png"} <= set(out)
    return out


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """An sshd on 127.0.0.1 only, accepting one throwaway key; stopped (by its pid) after the module."""
    if not SSHD.exists():
        pytest.skip("openssh-server is not installed (apt-get install openssh-server; .ci/run does)")
    d = tmp_path_factory.mktemp("sshd")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "hostkey")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "client_key")], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'hostkey'}
AuthorizedKeysFile {d / 'authorized_keys'}
PidFile {d / 'sshd.pid'}
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
AllowTcpForwarding no
X11Forwarding no
Subsystem sftp internal-sftp
""")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation dir (systemd makes it)
    log = open(d / "sshd.log", "w")  # noqa: SIM115 (the daemon writes to it until the module ends)
    proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, (d / "sshd.log").read_text()
            time.sleep(0.2)
    try:
        yield {"port": port, "key": d / "client_key", "store": d / "store", "user": os.environ.get("USER", "root")}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A git copy of this checkout (tracked + untracked-not-ignored files, plus data/raw)."""
    root = tmp_path_factory.mktemp("repo") / "reprotune"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / rel)
    home = root.parent / "home"  # ssh and git never read the real user's ~ here
    home.mkdir()
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(root / "src"),
           "PYTHONHASHSEED": "random", "HOME": str(home), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1"}
    sh(["git", "init", "-q", "-b", "main"], root, env)
    # make data: regenerate data/raw into the empty DVC cache and check it against data.dvc
    sh(["bash", "scripts/get_data.sh"], root, {**env, "DVC": str(VENV_BIN / "dvc"), "PY": sys.executable})
    sh(["git", "add", "-A"], root, env)
    sh(["git", "commit", "-q", "-m", "baseline"], root, env)
    return root, env


@pytest.fixture(scope="module")
def v1(repo: tuple[Path, dict]) -> dict:
    """Run the pipeline both ways with the same settings; commit the result as git tag v1."""
    root, env = repo
    sets = [*TINY, "train.learning_rate=1e-4"]
    # 1) DVC's Hydra integration composes conf/ + the -S overrides into params.yaml
    # up to eval: merge and gguf (llama.cpp) have their own tests; here they would only add minutes
    sh([str(VENV_BIN / "dvc"), "exp", "run", "eval", *[a for s in sets for a in ("-S", s)]], root, env)
    exp_params = yaml.safe_load((root / "params.yaml").read_text())
    exp_manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    exp_metrics = (root / "outputs/train/metrics.json").read_bytes()
    exp_outputs = sorted(p.name for p in (root / "outputs").iterdir())
    # 2) make repro's way: python -m reprotune.config (make params) writes params.yaml, then dvc repro. Train is
    # forced to run again (its bytes are compared below); then a plain dvc repro must find prepare and eval
    # current: make's params.yaml gives them the params the exp run recorded, and eval the same adapter bytes
    sh([sys.executable, "-m", "reprotune.config", *sets], root, env)
    log = sh([str(VENV_BIN / "dvc"), "repro", "--force", "--single-item", "train"], root, env)
    after = sh([str(VENV_BIN / "dvc"), "repro", "eval"], root, env)
    manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    sh(["git", "add", "-A"], root, env)
    sh(["git", "commit", "-q", "-m", "v1: lr 1e-4"], root, env)
    sh(["git", "tag", "v1"], root, env)
    return {"exp_params": exp_params, "exp_manifest": exp_manifest, "exp_metrics": exp_metrics,
            "exp_outputs": exp_outputs, "manifest": manifest, "log": log, "after": after, "hashes": hashes(root)}


def test_exp_run_and_make_repro_run_the_same(repo: tuple[Path, dict], v1: dict) -> None:
    root, _ = repo
    assert v1["exp_params"]["train"]["learning_rate"] == 1e-4
    assert "hydra" not in v1["exp_params"]  # DVC's form; the stage command line supplies Hydra's runtime keys
    exp, rep = v1["exp_manifest"], v1["manifest"]
    assert exp["config"] == rep["config"], "dvc exp run and make repro resolved different configs"
    assert exp["config"]["train"]["learning_rate"] == 1e-4 and exp["config"]["model"]["name"] == "tiny_random"
    print(f"exp run adapter {exp['outputs']['adapter']['sha256']}, make repro adapter {rep['outputs']['adapter']['sha256']}")
    assert exp["outputs"]["adapter"]["files"] == rep["outputs"]["adapter"]["files"]
    assert v1["exp_metrics"] == (root / "outputs/train/metrics.json").read_bytes()
    # no Hydra run folders or log files next to the declared outputs
    assert v1["exp_outputs"] == sorted(p.name for p in (root / "outputs").iterdir()) == ["adapter", "eval", "train"]
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert lock["stages"]["train"]["params"]["params.yaml"]["train"]["learning_rate"] == 1e-4
    assert "Running stage 'train'" in v1["log"]
    assert "Stage 'prepare' didn't change, skipping" in v1["after"]
    assert "Stage 'eval' didn't change, skipping" in v1["after"] and "Running stage" not in v1["after"]


@pytest.fixture(scope="module")
def v2(repo: tuple[Path, dict], v1: dict) -> dict:
    """Edit conf/ (the default learning rate), regenerate params.yaml, dvc repro: a second version, tag v2."""
    root, env = repo
    conf = root / "conf/train/default.yaml"
    conf.write_text(conf.read_text().replace("learning_rate: 1.0e-3", "learning_rate: 5.0e-4"))
    sh([sys.executable, "-m", "reprotune.config", *TINY], root, env)
    log = sh([str(VENV_BIN / "dvc"), "repro", "eval"], root, env)
    sh(["git", "add", "-A"], root, env)
    sh(["git", "commit", "-q", "-m", "v2: lr 5e-4 in conf/"], root, env)
    sh(["git", "tag", "v2"], root, env)
    return {"log": log, "hashes": hashes(root),
            "manifest": json.loads((root / "outputs/train/manifest.json").read_text())}


def test_editing_conf_reruns_only_what_changed(v1: dict, v2: dict) -> None:
    assert v2["manifest"]["config"]["train"]["learning_rate"] == 5e-4
    assert "Stage 'prepare' didn't change, skipping" in v2["log"]
    assert "Running stage 'train'" in v2["log"]
    assert v2["hashes"]["outputs/adapter/adapter_model.safetensors"] != \
        v1["hashes"]["outputs/adapter/adapter_model.safetensors"]
    assert {k: v for k, v in v2["hashes"].items() if k.startswith("data/")} == \
        {k: v for k, v in v1["hashes"].items() if k.startswith("data/")}


def test_metrics_show_and_diff_print_numbers(repo: tuple[Path, dict], v1: dict, v2: dict) -> None:
    """What a DVC user compares two runs with: every metric a number, and v1 -> v2 (another learning rate)
    shows up as a change of the tuned model's holdout loss."""
    root, env = repo
    dvc = str(VENV_BIN / "dvc")
    def last_json(out: str) -> dict:  # sh() returns stdout + stderr; DVC prints the JSON on one line
        return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])

    shown = last_json(sh([dvc, "metrics", "show", "--json"], root, env))
    files = shown["workspace"]["data"] if "workspace" in shown else shown[next(iter(shown))]["data"]
    # the preference chain's metrics are declared too, though that chain has not run here
    assert set(files) - {"data/pairs/metrics.json", "outputs/pref/train/metrics.json", "outputs/pref/eval/metrics.json",
                         "outputs/export/gguf_metrics.json", "outputs/pref/export/gguf_metrics.json"} == {"data/prepared/metrics.json", "outputs/train/metrics.json",
                                   "outputs/eval/metrics.json"}

    def flat(d: dict, prefix: str = "") -> dict:
        return {k2: v2 for k, v in d.items()
                for k2, v2 in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])}

    for name, entry in files.items():
        if name.startswith(("data/pairs/", "outputs/pref/", "outputs/export/")):
            continue  # declared, not written (the preference chain, make gguf): DVC reports them missing
        values = flat(entry["data"])
        assert values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values.values()), \
            (name, {k: v for k, v in values.items() if not isinstance(v, int | float) or isinstance(v, bool)})
    diff = last_json(sh([dvc, "metrics", "diff", "v1", "v2", "--json"], root, env))
    # two steps with warmup: the logged train loss is the same, the adapters (and the holdout loss) are not
    tuned = diff["outputs/eval/metrics.json"]["tuned.loss"]
    assert tuned["old"] != tuned["new"] and tuned["diff"] == pytest.approx(tuned["new"] - tuned["old"])
    assert "data/prepared/metrics.json" not in diff  # the data did not change between v1 and v2


def test_ssh_push_wipe_pull_and_old_version(repo: tuple[Path, dict], v1: dict, v2: dict, sshd: dict) -> None:
    root, env = repo
    dvc = str(VENV_BIN / "dvc")
    url = f"ssh://{sshd['user']}@127.0.0.1:{sshd['port']}{sshd['store']}"
    sh([dvc, "remote", "add", "--local", "-f", "-d", "sshtest", url], root, env)
    sh([dvc, "remote", "modify", "--local", "sshtest", "keyfile", str(sshd["key"])], root, env)

    started = time.time()
    sh([dvc, "push", "--all-tags"], root, env)  # both adapter versions (and the data)
    TIMINGS["push"] = time.time() - started
    assert any(sshd["store"].rglob("*")), "nothing arrived on the SSH remote"

    # wipe everything DVC manages, locally
    for gone in (".dvc/cache", "data/raw", "data/prepared", "outputs"):
        shutil.rmtree(root / gone)
    started = time.time()
    sh([dvc, "pull", *RUN_STAGES], root, env)
    TIMINGS["pull"] = time.time() - started
    assert hashes(root) == v2["hashes"]
    assert "up to date" in sh([dvc, "status", *RUN_STAGES], root, env)

    # an old adapter version by git revision, two ways: checkout + pull, and dvc get (no checkout)
    v1_adapter = {k.removeprefix("outputs/adapter/"): v for k, v in v1["hashes"].items()
                  if k.startswith("outputs/adapter/")}
    sh(["git", "checkout", "-q", "v1"], root, env)
    started = time.time()
    sh([dvc, "pull", *RUN_STAGES], root, env)
    TIMINGS["pull_old_version"] = time.time() - started
    try:
        assert hashes(root) == v1["hashes"]
    finally:
        sh(["git", "checkout", "-q", "main"], root, env)
        sh([dvc, "checkout", "--quiet", *RUN_STAGES], root, env)
    shutil.rmtree(root / ".dvc/cache")  # dvc get must fetch v1 from the SSH remote
    sh([dvc, "get", ".", "outputs/adapter", "--rev", "v1", "-o", str(root.parent / "adapter-v1")], root, env)
    assert sha256_tree(root.parent / "adapter-v1") == v1_adapter
    sh([dvc, "fetch", "--all-tags"], root, env)  # leave the cache whole for the next test
    files = sum(1 for p in sshd["store"].rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in sshd["store"].rglob("*") if p.is_file())
    print(f"\nDVC over SSH (127.0.0.1): push {TIMINGS['push']:.1f}s, pull {TIMINGS['pull']:.1f}s, "
          f"pull of v1 {TIMINGS['pull_old_version']:.1f}s; remote holds {files} objects, {size / 1e6:.1f} MB")


def test_verify_a_git_revision(repo: tuple[Path, dict], v1: dict, v2: dict) -> None:
    """make verify RUN=v1: v1's own code re-runs v1's stages from its dvc.lock and matches byte for byte."""
    root, env = repo
    proc = subprocess.run([sys.executable, "-m", "reprotune.verify", "v1"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-1500:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("RESULT: identical") == 3  # prepare, train and eval
    assert "verify train at v1" in proc.stdout and "output adapter" in proc.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=root, capture_output=True, text=True).stdout
    assert len(worktrees.strip().splitlines()) == 1  # the temporary worktree is gone
