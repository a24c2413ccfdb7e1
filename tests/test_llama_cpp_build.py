"""scripts/build_llama_cpp.sh's choice of CPU kernels: x86-64-v3 SIMD where the CPU has it, a clear stop where a
build would die of an illegal instruction, and bad input refused before anything is fetched or compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

SCRIPT = REPO / "scripts/build_llama_cpp.sh"


def build_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The build script with an empty cache in tmp_path; the tests below stop it before it fetches anything."""
    full = {**os.environ, "VENV": str(Path(sys.executable).parent.parent),
            "LLAMA_CPP_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=60)


def test_unknown_cpu_level_is_refused(tmp_path: Path) -> None:
    proc = build_script(tmp_path, LLAMA_CPP_CPU="native")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("build_llama_cpp: LLAMA_CPP_CPU must be auto, x86-64-v3 or portable, "
                                   "not 'native'")
    assert not list((tmp_path / "cache").iterdir())  # nothing fetched


def test_x86_64_v3_on_a_cpu_without_avx2_stops_instead_of_crashing(tmp_path: Path) -> None:
    """An x86-64-v3 build on a CPU without AVX2 would die of SIGILL inside llama.cpp; the script says why first."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 sse4_1 sse4_2 avx\n")  # an Ivy Bridge, say
    proc = build_script(tmp_path, LLAMA_CPP_CPU="x86-64-v3", LLAMA_CPP_CPUINFO=str(cpuinfo))
    assert proc.returncode == 1
    if os.uname().machine == "x86_64":
        assert ("LLAMA_CPP_CPU=x86-64-v3, but this CPU lacks f16c fma avx2 bmi2: use LLAMA_CPP_CPU=auto or "
                "portable") in proc.stderr
    assert "fetching" not in proc.stderr and not list((tmp_path / "cache").iterdir())


def test_auto_without_avx2_says_it_builds_the_portable_kernels(tmp_path: Path) -> None:
    """auto on such a CPU falls back to the portable build and says what that costs (then stopped before any
    download by the cache's NOT-BUILT marker, as in an image built without llama.cpp)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse sse2 sse4_1 sse4_2 avx f16c fma\n")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache/NOT-BUILT").write_text("built without llama.cpp (test)")
    proc = build_script(tmp_path, LLAMA_CPP_CPUINFO=str(cpuinfo))
    assert proc.returncode == 1
    if os.uname().machine == "x86_64":
        assert "this CPU lacks avx2 bmi2: llama.cpp is built without x86 SIMD (portable" in proc.stderr
    assert "built without llama.cpp (test): rebuild it with llama.cpp" in proc.stderr
