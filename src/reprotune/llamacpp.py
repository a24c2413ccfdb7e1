"""The pinned llama.cpp, as the export stages use it.

llama.cpp comes from the hash-pinned llama-cpp-python sdist (lockfiles/llama-cpp.txt), built once by
scripts/build_llama_cpp.sh: its wheel gives libllama with Python bindings (model loading, tokenizer,
llama_model_quantize, the OpenAI-compatible server), and its vendored source tree gives
convert_hf_to_gguf.py with the gguf-py it was written for. Everything here talks to that one build.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build_llama_cpp.sh"

# llama.cpp's own words for a GGUF whose generation will be wrong (src/llama-vocab.cpp); any of them fails
# the export. An unknown pre-tokenizer fails earlier, in the converter.
DEGRADING_WARNINGS = (
    "GENERATION QUALITY WILL BE DEGRADED",
    "missing pre-tokenizer",
    "is not in special_eog_ids",
    "control-looking token",
    "bad special token",
    "out of vocab range",
    "reconvert",
    "newline token not found",
    "missing newline token",
)


def source_dir(configured: str | None = None) -> Path:
    """The vendored llama.cpp tree (convert_hf_to_gguf.py, gguf-py); builds and installs it on first use."""
    if configured:
        path = Path(configured)
    else:
        env = dict(os.environ, VENV=str(Path(sys.prefix)))
        proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, env=env, text=True)
        if proc.returncode != 0:
            raise ReprotuneError(f"gguf: {BUILD_SCRIPT.name} failed (exit {proc.returncode}); see its output above")
        path = Path(proc.stdout.strip().splitlines()[-1])
    if not (path / "convert_hf_to_gguf.py").is_file():
        raise ReprotuneError(f"gguf: {path} is not a llama.cpp source tree (no convert_hf_to_gguf.py)")
    return path


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def system_info() -> str:
    """What the loaded ggml was compiled with ("AVX2 = 1 | F16C = 1 | FMA = 1 | ..."): the kernels whose float
    arithmetic the greedy parity answers depend on (scripts/build_llama_cpp.sh chooses them)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()


@contextmanager
def captured_log(on_line: Callable[[int, str], None] | None = None) -> Iterator[list[tuple[int, str]]]:
    """Collect llama.cpp's log lines (level, text) while the block runs; optionally watch each one.

    Levels follow ggml.h of the pinned llama.cpp: 1 debug, 2 info, 3 warn, 4 error, 5 continuation.
    """
    import llama_cpp
    import llama_cpp._logger as default_logger

    lines: list[tuple[int, str]] = []

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        message = text.decode("utf-8", errors="replace")
        lines.append((level, message))
        if on_line is not None:
            on_line(level, message)

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(default_logger.llama_log_callback, ctypes.c_void_p(0))


WARN, ERROR = 3, 4


# "control-looking token: %6d '%s' was not control-type; ... its type will be overridden" (src/llama-vocab.cpp):
# a token whose text is on llama.cpp's list of end-of-turn spellings becomes a control, end-of-generation token
CONTROL_LOOKING = re.compile(r"control-looking token:\s+(\d+) '(.*)' was not control-type")


def control_looking(text: str) -> tuple[int, str] | None:
    """(id, text) of the token a control-looking-token warning names, else None."""
    match = CONTROL_LOOKING.search(text)
    return (int(match.group(1)), match.group(2)) if match else None


def degrading_warnings(lines: list[tuple[int, str]], accepted: frozenset[tuple[int, str]] = frozenset()
                       ) -> list[str]:
    """Lines in which llama.cpp says generation will be wrong (matched at any level: the phrases are specific),
    but the control-looking-token warnings for exactly the (id, text) tokens in `accepted`."""
    return sorted({text.strip() for _, text in lines if any(w in text for w in DEGRADING_WARNINGS)
                   and control_looking(text) not in accepted})


def warnings_of(lines: list[tuple[int, str]]) -> list[str]:
    return [text.strip() for level, text in lines if level in (WARN, ERROR) and text.strip()]


def gguf_info(src: Path, gguf: Path) -> dict[str, Any]:
    """Tensor type mix and tokenizer metadata of a GGUF, read with the vendored gguf-py (reprotune.gguf_inspect,
    in a subprocess, so that it never shadows the PyPI gguf that transformers uses in this process)."""
    package_root = str(Path(__file__).resolve().parents[1])  # this checkout's src/, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "reprotune.gguf_inspect", str(src / "gguf-py"), str(gguf)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ReprotuneError(f"gguf: cannot read {gguf}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


CHKHSH_RE = re.compile(r"chkhsh:\s*([0-9a-f]{64})")
