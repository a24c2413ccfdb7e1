"""Verify a recorded run: re-run its stage in a temporary directory and compare the outputs byte for byte.

    python -m reprotune.verify outputs/train/manifest.json    # == make verify RUN=outputs/train/manifest.json
    python -m reprotune.verify HEAD~3                         # == make verify RUN=HEAD~3 (every stage's manifest)

A manifest (written by every stage, see manifest.py) records the resolved config, the input and output
hashes and the environment (code, lock, packages, hardware, driver, image). Verification re-runs the stage
with that config on copies of the recorded inputs, in a fresh directory, and reports *identical* or
*different*; when different it names which recorded input differs (code, lock, data, config, hardware,
driver, image), or that none does (then the stage itself is not deterministic on this machine).

For a git revision, the manifests come from that revision's dvc.lock (DVC's cache, or the remote), and the
stage re-runs with that revision's code: a temporary `git worktree` at the revision, its data restored with
`dvc checkout`/`dvc pull`, then the manifest check above inside it.

Exit status: 0 identical, 1 different, 2 could not verify (one-line reason).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from reprotune.errors import ReprotuneError

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------- what a manifest records
def _config_without_paths(m: dict) -> dict:
    """The config minus where the run happened (paths, and values resolved under paths.root)."""
    config = m.get("config", {})
    root = str(config.get("paths", {}).get("root", ".")).rstrip("/") or "/"
    return {k: _reroot_strings(v, root, Path("<root>")) for k, v in config.items() if k != "paths"}


def _hardware(hw: dict) -> dict:
    """What the math ran on, most telling first: the CPU kernel level and its settings (the user's overridden
    values are left out: pinned mode replaced them), threads, the CPU, then the GPUs."""
    kernels = {k: v for k, v in (hw.get("cpu_kernels") or {}).items() if k != "user_env_overridden"}
    return {"cpu_kernels": kernels, "torch_threads": hw.get("torch_threads"), "cpu": hw.get("cpu"),
            "cpu_detail": hw.get("cpu_detail"), "machine": hw.get("machine"), "cpu_count": hw.get("cpu_count"),
            "gpus": hw.get("gpus")}


# Each category maps a manifest to the values that, when they change, may change the outputs.
CATEGORIES: dict[str, Any] = {
    # the source digest, not the git commit: a run is recorded before the commit that records it
    "code": lambda m: {"src_sha256": m.get("code", {}).get("src_sha256") or m.get("git", {}).get("commit")},
    "lock": lambda m: {"lockfile": m.get("lock", {}).get("sha256"), "variant": m.get("lock", {}).get("variant"),
                       "installed_packages": m.get("packages", {}).get("all_sha256")},
    "data": lambda m: {**{name: rec.get("sha256") for name, rec in m.get("inputs", {}).items()},
                       **({"objective.init_adapter": rec.get("sha256")} if (rec := start_adapter(m)) else {})},
    "config": _config_without_paths,
    "hardware": lambda m: _hardware(m.get("hardware", {})),
    "driver": lambda m: {"driver": m.get("hardware", {}).get("driver"), "torch": m.get("runtime", {}).get("torch"),
                         "cuda": m.get("runtime", {}).get("cuda"), "cudnn": m.get("runtime", {}).get("cudnn"),
                         "cuda_driver_api": m.get("hardware", {}).get("cuda_driver_api")},
    "image": lambda m: {"container_image": m.get("runtime", {}).get("container_image")},
}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def input_differences(recorded: dict, rerun: dict) -> dict[str, list[str]]:
    """Per category, the recorded values that differ in the re-run ('key: old -> new')."""
    diffs: dict[str, list[str]] = {}
    for name, pick in CATEGORIES.items():
        old, new = _flatten(pick(recorded)), _flatten(pick(rerun))
        # in the category's own order (most telling first), so the first line is the likeliest cause
        changed = [f"{k}: {_short(old.get(k))} -> {_short(new.get(k))}"
                   for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
        if changed:
            diffs[name] = changed
    return diffs


def output_differences(recorded: dict, rerun: dict) -> dict[str, str]:
    """Per recorded output: 'identical', or what differs."""
    result = {}
    for name, rec in recorded.get("outputs", {}).items():
        new = rerun.get("outputs", {}).get(name)
        if not isinstance(rec, dict) or "sha256" not in rec:
            continue
        if new is None:
            result[name] = "missing in the re-run"
        elif new.get("sha256") == rec["sha256"]:
            result[name] = "identical"
        else:
            files = sorted(k for k in set(rec.get("files", {})) | set(new.get("files", {}))
                           if rec.get("files", {}).get(k) != new.get("files", {}).get(k))
            result[name] = "different" + (f" ({', '.join(files)})" if files else "")
    return result


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 24 or not all(c in "0123456789abcdef" for c in text) else text[:12] + "…"


# --------------------------------------------------------------------------------- re-run from a manifest
def load_manifest(path: Path) -> dict:
    if not path.is_file():
        raise ReprotuneError(f"{path}: no such manifest (give a stage's manifest.json or a git revision)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise ReprotuneError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    for field in ("stage", "config", "outputs", "manifest_path"):
        if field not in manifest:
            raise ReprotuneError(f"{path}: field '{field}' missing: not a reprotune stage manifest (or too old)")
    return manifest


def manifest_root(path: Path, manifest: dict) -> Path:
    """The paths.root the manifest was written under, found from where the manifest is now."""
    rel = Path(manifest["manifest_path"])
    here = path.resolve()
    if here.as_posix().endswith("/" + rel.as_posix()):
        return Path(here.as_posix()[: -len(rel.as_posix()) - 1])
    return Path.cwd()


def rerooted_paths(paths: dict[str, Any], old_root: str, new_root: Path) -> dict[str, Any]:
    """Point every output location at new_root; the model cache (read-only, outside the run) stays."""
    out = {}
    for key, value in paths.items():
        if key == "root":
            out[key] = str(new_root)
        elif key == "model_cache" or not isinstance(value, str):
            out[key] = value
        else:
            rel = os.path.relpath(value, old_root)
            # a location outside root (e.g. checkpoints on a pod volume) must not be touched by a re-run
            out[key] = str(new_root / (rel if not rel.startswith("..") else f"external/{key}"))
    return out


def _reroot_strings(node: Any, old_root: str, new_root: Path) -> Any:
    if isinstance(node, dict):
        return {k: _reroot_strings(v, old_root, new_root) for k, v in node.items()}
    if isinstance(node, list):
        return [_reroot_strings(v, old_root, new_root) for v in node]
    if isinstance(node, str) and (node == old_root or node.startswith(old_root + "/")):
        return str(new_root) + node[len(old_root):]
    return node


def copy_inputs(manifest: dict, root: Path, tmp: Path) -> None:
    for name, rec in manifest.get("inputs", {}).items():
        rel = rec.get("path")
        if not rel or Path(rel).is_absolute():
            continue  # outside the run (e.g. the model cache): used in place, its hash is still compared
        src, dst = root / rel, tmp / rel
        if not src.exists():
            raise ReprotuneError(f"input '{name}' ({src}) is missing: restore it first (make pull, or dvc checkout)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)


def start_adapter(manifest: dict) -> dict | None:
    """The adapter a preference run started from (objective.init_adapter: its path and sha256), or None."""
    rec = (manifest.get("objective") or {}).get("init_adapter")
    return rec if isinstance(rec, dict) and rec.get("path") else None


def copy_start_adapter(manifest: dict, root: Path, tmp: Path) -> None:
    """A preference train's start adapter (recorded under objective, not inputs), checked against its recorded
    sha256 and copied into the re-run's root like an input; one outside the run's root is checked and used in
    place (the re-run's config names it by its absolute path). A start adapter that is missing or not the one
    the run started from is one line: the re-run would start from other weights."""
    from reprotune.manifest import path_record

    rec = start_adapter(manifest)
    if rec is None:
        return
    rel = Path(rec["path"])
    src = rel if rel.is_absolute() else root / rel
    if not (src / "adapter_config.json").is_file():
        raise ReprotuneError(f"objective.init_adapter: the start adapter {src} is missing: restore it first "
                             "(make pull, or dvc checkout train)")
    now = path_record(src)["sha256"]
    if now != rec.get("sha256"):
        raise ReprotuneError(f"objective.init_adapter: the start adapter {src} is not the one this run started "
                             f"from (sha256 {now[:16]}, the manifest records {str(rec.get('sha256'))[:16]}); restore "
                             "that adapter (dvc checkout train at the run's revision) and verify again")
    inside = not rel.is_absolute() and not os.path.normpath(rel).startswith("..")
    if inside:
        shutil.copytree(src, tmp / rel, dirs_exist_ok=True)


# DVC stage name -> module, where they differ ("eval" would shadow nothing, but reads badly as a module)
STAGE_MODULES = {"eval": "evaluate"}


def rerun_stage(manifest: dict, root: Path, tmp: Path, overrides: list[str]) -> dict:
    """Run the recorded stage with the recorded config (outputs re-rooted to tmp); return its new manifest."""
    config = json.loads(json.dumps(manifest["config"]))
    old_root = str(config["paths"]["root"]).rstrip("/") or "/"
    paths = rerooted_paths(config["paths"], old_root, tmp)
    config = _reroot_strings(config, old_root, tmp)  # resolved values such as data.path=<root>/data/raw/...
    config["paths"] = paths
    copy_inputs(manifest, root, tmp)
    copy_start_adapter(manifest, root, tmp)
    primary = {"defaults": [{"override hydra/job_logging": "stdout"}, "_self_"],
               "hydra": {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}}, **config}
    (tmp / "verify-config.yaml").write_text(yaml.safe_dump(primary, sort_keys=False))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    module = STAGE_MODULES.get(manifest["stage"], manifest["stage"])
    cmd = [sys.executable, "-m", f"reprotune.{module}", "--config-dir", str(tmp),
           "--config-name", "verify-config", *overrides]
    print(f"verify: re-running stage '{manifest['stage']}' in {tmp}", flush=True)
    proc = subprocess.run(cmd, env=env, cwd=Path.cwd())
    if proc.returncode != 0:
        raise ReprotuneError(f"the re-run of stage '{manifest['stage']}' failed (exit {proc.returncode}); see above")
    new_path = tmp / manifest["manifest_path"]
    if not new_path.is_file():
        raise ReprotuneError(f"the re-run wrote no manifest at {new_path}")
    return json.loads(new_path.read_text())


def verify_manifest(path: Path, overrides: list[str] | None = None, keep: bool = False) -> dict[str, Any]:
    """Re-run the stage of one manifest; returns {'identical': bool, 'outputs': ..., 'inputs_differ': ...}."""
    manifest = load_manifest(path)
    root = manifest_root(path, manifest)
    tmp = Path(tempfile.mkdtemp(prefix=f"reprotune-verify-{manifest['stage']}-"))
    try:
        rerun = rerun_stage(manifest, root, tmp, list(overrides or []))
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    outputs = output_differences(manifest, rerun)
    if not outputs:
        raise ReprotuneError(f"{path}: the manifest records no output hashes to compare")
    identical = all(v == "identical" for v in outputs.values())
    return {"stage": manifest["stage"], "manifest": str(path), "identical": identical, "outputs": outputs,
            "inputs_differ": input_differences(manifest, rerun), "rerun_dir": str(tmp) if keep else None,
            "repro": [str((m.get("seeds") or {}).get("repro", "default")) for m in (manifest, rerun)]}


# ----------------------------------------------------------------------------------- re-run a git revision
def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def manifests_at(rev: str, repo: Path) -> list[str]:
    """Paths of the stage manifests that the revision's dvc.lock records."""
    lock = _run(["git", "show", f"{rev}:dvc.lock"], repo)
    if lock.returncode != 0:
        raise ReprotuneError(f"{rev}: no dvc.lock at that revision (nothing was run with 'make repro' there)")
    stages = (yaml.safe_load(lock.stdout) or {}).get("stages", {})
    found = [out["path"] for st in stages.values() for out in st.get("outs", [])
             if Path(out["path"]).name.endswith("manifest.json")]
    if not found:
        raise ReprotuneError(f"{rev}: dvc.lock records no stage manifest (manifest.json outs)")
    return found


def verify_revision(rev: str, overrides: list[str] | None = None, keep: bool = False) -> list[dict[str, Any]]:
    repo = Path(_run(["git", "rev-parse", "--show-toplevel"], Path.cwd()).stdout.strip() or Path.cwd())
    commit = _run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], repo)
    if commit.returncode != 0:
        raise ReprotuneError(f"{rev}: neither a manifest file nor a git revision")
    manifests = manifests_at(rev, repo)
    dvc = str(Path(sys.executable).parent / "dvc")
    cache = _run([dvc, "cache", "dir"], repo).stdout.strip() or str(repo / ".dvc/cache")
    tmp = Path(tempfile.mkdtemp(prefix="reprotune-verify-rev-"))
    tree = tmp / "tree"
    try:
        added = _run(["git", "worktree", "add", "--detach", str(tree), commit.stdout.strip()], repo)
        if added.returncode != 0:
            raise ReprotuneError(f"git worktree add failed: {added.stderr.strip().splitlines()[-1]}")
        # the worktree shares this checkout's DVC cache (and remotes, via its own committed .dvc/config)
        _run([dvc, "cache", "dir", "--local", cache], tree)
        for local in (".dvc/config.local",):
            if (repo / local).is_file() and not (tree / local).exists():
                shutil.copy2(repo / local, tree / local)
        # only what the revision ran: stages never run there (no dvc.lock entry) have nothing to restore
        lock = tree / "dvc.lock"
        targets = list((yaml.safe_load(lock.read_text()) or {}).get("stages", {})) if lock.is_file() else []
        targets = (["data.dvc"] if (tree / "data.dvc").is_file() else []) + targets
        restored = _run([dvc, "checkout", "--quiet", *targets], tree)
        if restored.returncode != 0:
            restored = _run([dvc, "pull", "--quiet", *targets], tree)
        if restored.returncode != 0:
            raise ReprotuneError(f"{rev}: could not restore its data and outputs from the DVC cache or remote "
                              f"({(restored.stderr.strip().splitlines() or ['?'])[-1]})")
        if not (tree / "src/reprotune/verify.py").is_file():
            raise ReprotuneError(f"{rev}: that revision predates 'make verify' (no src/reprotune/verify.py)")
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        reports = []
        for rel in manifests:
            cmd = [sys.executable, "-m", "reprotune.verify", "--json", rel, *(["--keep"] if keep else []),
                   *(overrides or [])]
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            sys.stderr.write(proc.stderr[-4000:] if proc.returncode not in (0, 1) else "")
            report = _last_report(proc.stdout)
            if proc.returncode not in (0, 1) or report is None:
                raise ReprotuneError(f"{rev}: verifying {rel} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
            report["revision"] = rev
            reports.append(report)
        return reports
    finally:
        _run(["git", "worktree", "remove", "--force", str(tree)], repo)
        shutil.rmtree(tmp, ignore_errors=True)


def _last_report(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and "identical" in report:
            return report
    return None


# ----------------------------------------------------------------------------------------------- report
def print_report(report: dict[str, Any]) -> None:
    where = f" at {report['revision']}" if report.get("revision") else ""
    print(f"\nverify {report['stage']}{where} ({report['manifest']})")
    for name, verdict in report["outputs"].items():
        print(f"  output {name:<14} {verdict}")
    differ = report["inputs_differ"]
    for name in CATEGORIES:
        print(f"  input  {name:<14} {'differs' if name in differ else 'same'}")
        for line in differ.get(name, [])[:8]:
            print(f"           {line}")
    if report["identical"]:
        print("RESULT: identical")
    elif differ:
        first = next(iter(differ))
        print(f"RESULT: different; first recorded difference: {first} {differ[first][0]} "
              f"(inputs that differ: {', '.join(differ)})")
    elif "fast" in report.get("repro", []):
        print("RESULT: different, although no recorded input differs: a run was made with repro=fast, whose GPU "
              "kernels (FlashAttention's backward, index_add) add in whatever order their threads finish; "
              "repro=default gives the same bytes")
    else:
        print("RESULT: different, although no recorded input differs: the stage is not deterministic here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reprotune.verify", description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a stage's manifest.json, or a git revision")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the re-run (they show as config changes)")
    parser.add_argument("--keep", action="store_true", help="keep the re-run's directory")
    parser.add_argument("--json", action="store_true", help="print one JSON line per report")
    args = parser.parse_args(argv)
    try:
        if Path(args.run).suffix == ".json" or Path(args.run).is_file():
            reports = [verify_manifest(Path(args.run), args.overrides, args.keep)]
        else:
            reports = verify_revision(args.run, args.overrides, args.keep)
    except ReprotuneError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    for report in reports:
        print(json.dumps(report, sort_keys=True)) if args.json else print_report(report)
    return 0 if all(r["identical"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
