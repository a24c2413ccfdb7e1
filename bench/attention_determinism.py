"""The attention kernels of the GPU path, deterministic or not: same gradients twice, and what determinism costs.

    python bench/attention_determinism.py                       # Qwen3-8B's heads, 16,200 packed tokens in 20 examples
    python bench/attention_determinism.py --tokens 98304 --examples 1   # one long example

For each kernel the GPU path can take (torch's FlashAttention varlen kernel over packed examples, the same kernel
over DPO's pair layout with its gathered keys, SDPA over padded rows, flex attention), forward + backward is run
with torch's deterministic algorithms off (repro=fast) and on (repro=default and strict), each repeated: the table
gives the median milliseconds and whether every repeat gave the same dQ/dK/dV bytes as the first. Needs CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics

import torch


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _lengths(tokens: int, examples: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(examples, generator=g) + 0.5
    lengths = (weights / weights.sum() * tokens).long().clamp(min=16)
    lengths[-1] += tokens - int(lengths.sum())
    return [int(x) for x in lengths]


def _inputs(tokens: int, heads: int, kv_heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, grad


def varlen_packed(lengths: list[int], heads: int, kv_heads: int, dim: int):
    from reprotune.varlen_attention import _kernel

    varlen_attn, gqa = _kernel()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, grad = _inputs(sum(lengths), heads, kv_heads, dim)

    def step() -> str:
        q.grad = k.grad = v.grad = None
        out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(-1, 0), **gqa)
        out.backward(grad)
        return q.grad, k.grad, v.grad
    return step


def varlen_pairs(lengths: list[int], heads: int, kv_heads: int, dim: int):
    """DPO's pair layout (reprotune.preference.packed): each example a prompt and two answers; the queries of each
    answer attend to the prompt's keys, gathered by index (whose backward adds into the prompt's rows)."""
    from reprotune.varlen_attention import _kernel

    varlen_attn, gqa = _kernel()
    q_starts, q_lens, k_index, k_lens, start = [], [], [], [], 0
    for n in lengths:  # prompt p, chosen c, rejected r: documents [p + c] and [p + r]
        p = n // 3
        c = (n - p) // 2
        r = n - p - c
        q_starts += [start, start + p + c]
        q_lens += [p + c, r]
        k_index += list(range(start, start + p + c)) + list(range(start, start + p)) + list(range(start + p + c, start + n))
        k_lens += [p + c, p + r]
        start += n
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    index = torch.tensor(k_index, device="cuda")
    q, k, v, grad = _inputs(sum(lengths), heads, kv_heads, dim)

    def step() -> str:
        q.grad = k.grad = v.grad = None
        out = varlen_attn(q, k[index], v[index], cu_q, cu_k, max(q_lens), max(k_lens), window_size=(-1, 0), **gqa)
        out.backward(grad)
        return q.grad, k.grad, v.grad
    return step


def sdpa_padded(lengths: list[int], heads: int, kv_heads: int, dim: int):
    rows, longest = len(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (rows, heads, longest, dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(rows, kv_heads, longest, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(rows, kv_heads, longest, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def step() -> str:
        q.grad = k.grad = v.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)
        return q.grad, k.grad, v.grad
    return step


def measure(step, repeats: int) -> tuple[float, bool]:
    """Median milliseconds of forward + backward (CUDA events around the kernels alone), and whether every repeat's
    gradients hash to the first's (hashed after the timing)."""
    first = _digest(*step())  # warm-up, and the reference bytes
    times, same = [], True
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        same &= _digest(*grads) == first
    return statistics.median(times), same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16200)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    lengths = _lengths(args.tokens, args.examples)
    kernels = {"varlen, packed examples": varlen_packed, "varlen, DPO pair layout": varlen_pairs,
               "SDPA, padded rows": sdpa_padded}
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, torch "
          f"{torch.__version__}; {args.tokens} tokens in {args.examples} examples, {args.heads}/{args.kv_heads} heads "
          f"of {args.dim}\n")
    print("| kernel | fast: ms | fast: same bytes | default: ms | default: same bytes | default / fast |")
    print("|---|---|---|---|---|---|")
    for name, make in kernels.items():
        row = {}
        for mode, flag in (("fast", False), ("default", True)):
            torch.use_deterministic_algorithms(flag)
            try:
                row[mode] = measure(make(lengths, args.heads, args.kv_heads, args.dim), args.repeats)
            except RuntimeError as err:  # a kernel with no deterministic form raises under the flag
                row[mode] = (float("nan"), f"raised: {str(err).splitlines()[0][:80]}")
        torch.use_deterministic_algorithms(False)
        (fast_ms, fast_same), (det_ms, det_same) = row["fast"], row["default"]
        print(f"| {name} | {fast_ms:.2f} | {fast_same} | {det_ms:.2f} | {det_same} | {det_ms / fast_ms:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
