"""Host and GPU time of one RMSNorm, SwiGLU and RoPE call, forward and backward: Liger's Triton kernels against
torch's fused rms_norm and the model's own (transformers') modules, at a Qwen3-8B DPO micro-step's shapes.

    python bench/norm_kernels.py            # CUDA only; prints a table

A packed LoRA DPO step on the H200 waits on the host (docs/preference.md, "where a LoRA DPO step's time goes"):
what a kernel costs the host per call matters as much as its GPU time. 'host us' = wall time per call of a
1-token input (the GPU idles: the launch path alone); 'full us' = per call at the step's shape, synchronised.
"""

from __future__ import annotations

import time

import torch


def timed(fn, n: int) -> float:
    """Microseconds per call of fn() (forward and backward), after 5 warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def norms(hidden: int, eps: float = 1e-6) -> dict:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    eager = Qwen3RMSNorm(hidden, eps).cuda().bfloat16()
    liger = LigerRMSNorm(hidden, eps, casting_mode="llama", init_fn="ones", in_place=False).cuda().bfloat16()
    weight = eager.weight

    def fused(x):
        return torch.nn.functional.rms_norm(x, (hidden,), weight, eps)

    return {"eager (transformers)": eager, "liger": liger, "torch fused rms_norm": fused}


def swiglus(intermediate: int) -> dict:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return {"eager silu(g) * u": lambda g, u: torch.nn.functional.silu(g) * u,
            "liger": LigerSiLUMulFunction.apply}


def fwd_bwd(fn, *shapes):
    xs = [torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]

    def run():
        out = fn(*xs)
        out.sum().backward()
    return run


def main() -> None:
    tokens, hidden, intermediate, heads, head_dim = 3752, 4096, 12288, 32, 128  # 4 packed pairs of Qwen3-8B
    rows = []
    for name, fn in norms(hidden).items():
        rows.append(("RMSNorm (hidden)", name, timed(fwd_bwd(fn, (1, hidden)), 300),
                     timed(fwd_bwd(fn, (tokens, hidden)), 50)))
    for name, fn in norms(head_dim).items():
        rows.append(("RMSNorm (q heads)", name, timed(fwd_bwd(fn, (1, heads, head_dim)), 300),
                     timed(fwd_bwd(fn, (tokens, heads, head_dim)), 50)))
    for name, fn in swiglus(intermediate).items():
        rows.append(("SwiGLU", name, timed(fwd_bwd(fn, (1, intermediate), (1, intermediate)), 300),
                     timed(fwd_bwd(fn, (tokens, intermediate), (tokens, intermediate)), 50)))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; forward + backward per call\n")
    print(f"| op | kernel | host us (1 token) | full us ({tokens} tokens) |\n|---|---|---|---|")
    for op, name, host, full in rows:
        print(f"| {op} | {name} | {host:,.0f} | {full:,.0f} |")


if __name__ == "__main__":
    main()
