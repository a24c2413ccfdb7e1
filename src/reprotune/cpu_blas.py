"""Pinned mode's fp32 matrix products on the CPU: OpenBLAS's Haswell kernels, in pieces fixed by the shape.

MKL gives the same bytes on Intel and AMD CPUs only in its COMPATIBLE branch, which runs the products as SSE2
code (the built-in model trained at ~0.4x the native speed). The OpenBLAS that numpy's wheel bundles
(`numpy.libs/libscipy_openblas64_*.so`, already in the lock) is built with DYNAMIC_ARCH: `OPENBLAS_CORETYPE=Haswell`
(pinned before anything loads, reprotune.kernels) makes it run its AVX2+FMA Haswell kernels with Haswell's fixed
blocking (GEMM_Q, the K-dimension block, is a per-core-type constant in OpenBLAS's setparam-ref.c, not read from the
host's cache) on every x86-64 CPU with AVX2, Intel or AMD. Two things still follow the host, and are avoided here:

- OpenBLAS's own threads. Its threaded driver splits M and N by thread count, and the kernel's tile shapes follow
  the split, and its single-threaded driver halves a K remainder between GEMM_Q and 2*GEMM_Q differently from the
  threaded one: 1, 2, 3, 4 and 8 threads gave five different results for one [502, 1536] x [1536, 576] product
  (OpenBLAS 0.3.31). So every call here is single-threaded, and the parallelism is ours: a product is cut into
  pieces by its shape alone (`pieces`), and the pieces run on `torch.get_num_threads()` threads. The bytes do not
  depend on the thread count.
- The CBLAS row-major entry: on an AVX-512 host it takes OpenBLAS's `sgemm_direct` kernel (chosen by the host's
  cpuid, not the core type) for some shapes. Calls here go through the Fortran entry (`sgemm_`), column-major.

`install()` registers these as the CPU kernels of aten::mm, mm.out, addmm, addmm.out and addmm_ for float32
(torch.library; other dtypes, and empty or unusual tensors, go to torch's own kernel), so nn.Linear, LoRA, the LM
head and their backward all land here. Matrix products inside other ATen kernels (CPU flash attention's blocks)
stay on MKL's COMPATIBLE branch. `hardware.cpu_kernels=native` does not install anything.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CORETYPE = "Haswell"  # must equal kernels.PINNED["x86_64"]["OPENBLAS_CORETYPE"] (checked at install)
OPS = ("mm", "mm.out", "addmm", "addmm.out", "addmm_")
# A product is cut only when it has this many multiply-adds (below, handing a piece to a thread costs more than it
# saves), along its larger output dimension, into at most MAX_PIECES pieces of a multiple of PIECE rows or columns
# (a multiple of every tile width of the Haswell kernel). Fixed numbers: the cut is a function of the shape only.
SPLIT_MACS = 1 << 24
PIECE = 64
MAX_PIECES = 16

_I = ctypes.c_int64
_F = ctypes.c_float
_state: dict[str, Any] = {}
_lock = threading.Lock()


def library_path() -> str | None:
    """numpy's bundled OpenBLAS (64-bit integer interface, `scipy_` symbol prefix), or None."""
    import numpy

    found = sorted(glob.glob(os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs",
                                          "libscipy_openblas64_*.so")))
    return os.path.realpath(found[0]) if found else None


class OpenBLAS:
    """The few OpenBLAS entries used: sgemm (Fortran interface), the thread count and the build's identity."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        ptr = ctypes.POINTER
        self._sgemm = lib.scipy_sgemm_64_
        self._sgemm.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ptr(_I), ptr(_I), ptr(_I), ptr(_F), ctypes.c_void_p,
                                ptr(_I), ctypes.c_void_p, ptr(_I), ptr(_F), ctypes.c_void_p, ptr(_I)]
        self._sgemm.restype = None
        config, corename = lib.scipy_openblas_get_config64_, lib.scipy_openblas_get_corename64_
        config.restype = corename.restype = ctypes.c_char_p
        self.config = config().decode()
        self.corename = corename().decode()
        self._set_threads = lib.scipy_openblas_set_num_threads64_
        self._set_threads.argtypes = [ctypes.c_int]
        self.calls = 0

    def single_threaded(self) -> None:
        self._set_threads(1)

    def sgemm(self, ta: bytes, tb: bytes, m: int, n: int, k: int, alpha: float, a: int, lda: int, b: int, ldb: int,
              beta: float, c: int, ldc: int) -> None:
        """Column-major C = alpha * op(A) op(B) + beta * C (ctypes lets other threads run meanwhile)."""
        self.calls += 1
        self._sgemm(ta, tb, _I(m), _I(n), _I(k), _F(alpha), a, _I(lda), b, _I(ldb), _F(beta), c, _I(ldc))


def _transposed_operand(x: Any) -> tuple[bytes, int, Any]:
    """(trans flag, leading dimension, tensor) that give x's transpose to column-major sgemm without a copy where
    x is row- or column-major (a transposed weight is column-major); anything else is copied contiguous."""
    rows, cols = x.shape
    s0 = x.stride(0) if rows > 1 else max(cols, 1)
    s1 = x.stride(1) if cols > 1 else 1
    if s1 == 1 and s0 >= max(cols, 1):
        return b"N", s0, x
    t0 = x.stride(0) if rows > 1 else 1
    t1 = x.stride(1) if cols > 1 else max(rows, 1)
    if t0 == 1 and t1 >= max(rows, 1):
        return b"T", t1, x
    return b"N", max(cols, 1), x.contiguous()


def pieces(m: int, n: int, k: int) -> tuple[int, list[tuple[int, int]]]:
    """How a [m, k] x [k, n] product is cut: (0: rows of the output, 1: columns; the (start, stop) of each piece).
    A function of the shape alone, so the bytes do not depend on how many threads compute the pieces."""
    dim, size = (0, m) if m >= n else (1, n)
    count = min(MAX_PIECES, size // PIECE) if m * n * k >= SPLIT_MACS else 1
    if count <= 1:
        return dim, [(0, size)]
    step = -(-size // count)
    step = -(-step // PIECE) * PIECE
    return dim, [(s, min(size, s + step)) for s in range(0, size, step)]


def _pool(threads: int) -> ThreadPoolExecutor | None:
    """Worker threads beside the caller (none for one thread); a fresh pool after a fork or a new thread count."""
    if threads <= 1:
        return None
    key = (os.getpid(), threads)
    with _lock:
        if _state.get("pool_key") != key:
            _state["pool"] = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="reprotune-sgemm")
            _state["pool_key"] = key
        return _state["pool"]


def _run(tasks: list[Callable[[], None]], threads: int) -> None:
    """Run the pieces: thread j takes pieces j, j+T, j+2T... (which thread computes a piece does not matter)."""
    pool = _pool(min(threads, len(tasks)))
    if pool is None:
        for task in tasks:
            task()
        return
    lanes = min(threads, len(tasks))
    futures = [pool.submit(lambda j=j: [task() for task in tasks[j::lanes]]) for j in range(1, lanes)]
    for task in tasks[0::lanes]:
        task()
    for future in futures:
        future.result()


def gemm_into(out: Any, a: Any, b: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """out = alpha * a @ b + beta * out for row-major float32 `out` [m, n] (out's stride(1) == 1), in OpenBLAS
    pieces. Row-major C is column-major Cᵀ = Bᵀ Aᵀ: sgemm(m=n, n=m) with B first."""
    import torch

    blas: OpenBLAS = _state["blas"]
    m, k = a.shape
    n = b.shape[1]
    dim, cuts = pieces(m, n, k)
    a, b = _transposed_operand(a)[2], _transposed_operand(b)[2]  # one copy, if any, before the cut
    tasks = []
    for start, stop in cuts:
        pa, pb, pc = (a[start:stop], b, out[start:stop]) if dim == 0 else (a, b[:, start:stop], out[:, start:stop])
        tb, ldb, pb = _transposed_operand(pb)
        ta, lda, pa = _transposed_operand(pa)
        rows, cols = pc.shape
        ldc = pc.stride(0) if rows > 1 else max(cols, 1)
        tasks.append(lambda tb=tb, ta=ta, cols=cols, rows=rows, pb=pb, ldb=ldb, pa=pa, lda=lda, pc=pc, ldc=ldc:
                     blas.sgemm(tb, ta, cols, rows, k, alpha, pb.data_ptr(), ldb, pa.data_ptr(), lda, beta,
                                pc.data_ptr(), ldc))
    _run(tasks, torch.get_num_threads())
    return out


def _ours(*tensors: Any) -> bool:
    """float32, 2-D, non-empty, no lazy negation/conjugation: the cases sgemm computes; the rest is torch's."""
    import torch

    return all(t.dtype == torch.float32 and t.dim() == 2 and t.numel() > 0 and not t.is_neg() for t in tensors)


def _shares_memory(out: Any, *inputs: Any) -> bool:
    """out written while an input is read from the same storage: left to torch's kernel, which handles it."""
    return any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs)


def _row_major(t: Any) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def _kernels(original: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    import torch

    def mm(keys: Any, a: Any, b: Any) -> Any:
        if not _ours(a, b):
            return original["mm"].call_boxed(keys, a, b)
        return gemm_into(torch.empty(a.shape[0], b.shape[1], dtype=a.dtype), a, b)

    def mm_out(keys: Any, a: Any, b: Any, *, out: Any) -> Any:
        if not (_ours(a, b) and out.dtype == torch.float32) or _shares_memory(out, a, b):
            return original["mm.out"].call_boxed(keys, a, b, out=out)
        out.resize_(a.shape[0], b.shape[1])
        if _row_major(out):
            return gemm_into(out, a, b)
        return out.copy_(gemm_into(torch.empty(out.shape, dtype=out.dtype), a, b))

    def filled(self: Any, shape: tuple[int, int], beta: float) -> Any:
        c = torch.empty(shape, dtype=torch.float32)
        return c.copy_(self.expand(shape)) if beta != 0 else c

    def addmm(keys: Any, self: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
        if not (_ours(a, b) and self.dtype == torch.float32):
            return original["addmm"].call_boxed(keys, self, a, b, beta=beta, alpha=alpha)
        shape = (a.shape[0], b.shape[1])
        return gemm_into(filled(self, shape, beta), a, b, float(alpha), float(beta))

    def addmm_out(keys: Any, self: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1, out: Any) -> Any:
        if not (_ours(a, b) and self.dtype == out.dtype == torch.float32) or _shares_memory(out, self, a, b):
            return original["addmm.out"].call_boxed(keys, self, a, b, beta=beta, alpha=alpha, out=out)
        shape = (a.shape[0], b.shape[1])
        result = gemm_into(filled(self, shape, beta), a, b, float(alpha), float(beta))
        out.resize_(shape)
        return out.copy_(result)

    def addmm_(keys: Any, self: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
        if not (_ours(self, a, b) and tuple(self.shape) == (a.shape[0], b.shape[1])) or _shares_memory(self, a, b):
            return original["addmm_"].call_boxed(keys, self, a, b, beta=beta, alpha=alpha)
        if _row_major(self):
            return gemm_into(self, a, b, float(alpha), float(beta))
        return self.copy_(gemm_into(self.contiguous(), a, b, float(alpha), float(beta)))

    return {"mm": mm, "mm.out": mm_out, "addmm": addmm, "addmm.out": addmm_out, "addmm_": addmm_}


def install() -> dict[str, Any]:
    """Route torch's CPU float32 matrix products through OpenBLAS (idempotent); returns `state()`. Raises
    ReprotuneError when the bundled OpenBLAS is missing or did not take the pinned core type (the bytes would
    then be another kernel's)."""
    import warnings

    import torch

    from reprotune.errors import ReprotuneError

    with _lock:
        if "library" in _state:
            return state()
        path = library_path()
        if path is None:
            raise ReprotuneError("hardware.cpu_kernels=pinned: numpy's bundled OpenBLAS (numpy.libs/"
                                 "libscipy_openblas64_*.so) was not found; reinstall the locked numpy, or use "
                                 "hardware.cpu_kernels=native")
        blas = OpenBLAS(path)
        if blas.corename != CORETYPE:
            raise ReprotuneError(
                f"hardware.cpu_kernels=pinned: OpenBLAS runs its {blas.corename!r} kernels, not {CORETYPE!r} "
                f"(OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')!r} when it loaded; a CPU without AVX2 and "
                "FMA cannot run them): use hardware.cpu_kernels=native")
        blas.single_threaded()
        _state["blas"] = blas
        original = {op: torch.library.get_kernel(f"aten::{op}", "CPU") for op in OPS}
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for op, fn in _kernels(original).items():
                library.impl(op, fn, "CPU", with_keyset=True)
        _state["library"] = library  # kept alive: the registrations last as long as this object
    return state()


def state() -> dict[str, Any] | None:
    """What the CPU's float32 matrix products run on when installed (for the manifest), else None."""
    blas = _state.get("blas")
    if "library" not in _state or blas is None:
        return None
    return {"library": "openblas", "build": blas.config, "core": blas.corename,
            "file": os.path.basename(blas.path), "ops": list(OPS), "threads_per_call": 1,
            "pieces": {"split_macs": SPLIT_MACS, "piece": PIECE, "max_pieces": MAX_PIECES}}


def calls() -> int:
    """sgemm calls made through the route so far (tests: proof that a product went through OpenBLAS)."""
    blas = _state.get("blas")
    return blas.calls if blas is not None else 0
