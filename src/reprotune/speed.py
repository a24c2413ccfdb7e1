"""The fast GPU path of the train stage, and how fast a run went.

What `make train` picks on a GPU without being told (hardware=gpu or hardware=auto on a GPU host):
- padding-free packing (TRL's best-fit-decreasing packing): examples are packed into rows of up to
  train.max_length tokens and flattened into one sequence per micro-batch; position ids restart at every
  example, so attention is block-diagonal (transformers builds the mask from the position ids) and no token
  attends across examples; the assistant-only loss mask is carried through packing unchanged;
- an attention kernel that skips the masked blocks of that block-diagonal mask (flex attention);
- Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (TRL already projects the LM head in tiles, so the logits are
  never materialised);
- LoRA's scale and add done inside the adapter's second matrix product (reprotune.fused_lora);
- activation checkpointing only when the run would not fit in GPU memory without it.
Each choice can be forced in conf/hardware/ (and train.packing); reprotune.sizing.decide makes them, once, and
records why. This module holds how those choices run (compile settings) and how fast a run went.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

# The FLOP formulas live low (reprotune.flops: the planner and the train stage import them from there). Re-exported
# here only for bench/dpo_recipe.py and bench/seed_recipe.py (speed.mfu, ...), which this branch may not edit: drop
# this import once they read reprotune.flops.
from reprotune.flops import (  # noqa: F401 - re-exported for bench/ only
    attention_flops_per_token,
    lora_step_flops_per_token,
    matmul_flops_per_token,
    mfu,
)

if TYPE_CHECKING:
    from reprotune.run_settings import RunSettings

log = logging.getLogger("reprotune.speed")


def apply_compile_settings(fast: RunSettings) -> None:
    """Flex attention's block mask and kernels are compiled by torch.compile. Packed micro-batches change length
    every step; by default dynamo first compiles for the static length and recompiles symbolically on the next
    length. On the H200 the static compile of the block mask did not finish in 150 s at 8,800+ tokens per
    micro-step (4,400: ~20 s), while the symbolic compile took ~8 s at any size; so compile symbolically at once."""
    if fast.dynamic_shapes:
        import torch._dynamo

        torch._dynamo.config.assume_static_by_default = False


# ------------------------------------------------------------------------------------------- measuring
def steady_rate(marks: list[tuple[int, float, int]], skip_first: int = 2, slow_factor: float = 1.2) -> float | None:
    """Steady tokens/s from (step, time, tokens seen) marks: the first `skip_first` steps are left out, and so is
    any later step whose seconds per token exceed `slow_factor` x the median step's. Why the second rule: on a
    fresh host compilation and autotuning can spill past the first steps (a first run then reads ~25% slower than
    the next); a median-anchored window reports the rate the run settles at, never a rate
    above its own median step."""
    steps = [(n1 - n0, t1 - t0) for (_, t0, n0), (_, t1, n1) in zip(marks, marks[1:], strict=False)][skip_first:]
    steps = [(n, t) for n, t in steps if n > 0 and t > 0]
    if not steps:
        return None
    median = statistics.median(t / n for n, t in steps)
    kept = [(n, t) for n, t in steps if t / n <= slow_factor * median]
    return sum(n for n, _ in kept) / sum(t for _, t in kept)


def step_timer_callback(skip_first: int = 2, stop_before: int | None = None):
    """A TrainerCallback timing every optimizer step (GPU-synchronised), so tokens/s can leave out the warm-up
    (kernel compilation, autotuning, allocator warm-up; `steady_rate`) as well as report the whole run."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[tuple[int, float, int]] = []  # (step, time, tokens seen)

        def _mark(self, state) -> None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.append((state.global_step, time.perf_counter(), int(state.num_input_tokens_seen)))

        def on_train_begin(self, args, state, control, **kwargs):
            self._mark(state)

        def on_step_end(self, args, state, control, **kwargs):
            self._mark(state)

        def steady_tokens_per_second(self) -> float | None:
            marks = [m for m in self.marks if stop_before is None or m[0] <= stop_before]
            return steady_rate(marks, skip_first)

        def step_seconds(self) -> list[float]:
            return [round(b[1] - a[1], 4) for a, b in zip(self.marks, self.marks[1:], strict=False)]

    return StepTimer()


def profiler_callback(steps: tuple[int, int], out_table: str):
    """torch.profiler over optimizer steps [first, last); writes the top CUDA kernels by time to out_table."""
    from transformers import TrainerCallback

    class Profile(TrainerCallback):
        prof = None

        def on_step_begin(self, args, state, control, **kwargs):
            import torch

            if state.global_step == steps[0] and self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.prof = torch.profiler.profile(activities=acts)
                torch.cuda.synchronize()
                self.started = time.perf_counter()
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            import torch

            if self.prof is not None and state.global_step >= steps[1]:
                torch.cuda.synchronize()
                wall = time.perf_counter() - self.started
                self.prof.__exit__(None, None, None)
                averages = self.prof.key_averages()
                try:
                    table = averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90)
                    busy = sum(a.self_device_time_total for a in averages) / 1e6
                except (AttributeError, KeyError):
                    table = averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
                    busy = sum(a.self_cuda_time_total for a in averages) / 1e6
                # where the host spends its time: a GPU that waits on Python shows up as busy << wall
                cpu = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90)
                gaps = idle_gaps_report(self.prof.events())
                os.makedirs(os.path.dirname(out_table), exist_ok=True)
                with open(out_table, "w") as fh:
                    fh.write(f"torch.profiler, optimizer steps {steps[0]}..{steps[1]}: {wall:.3f} s wall, "
                             f"{busy:.3f} s of GPU kernels ({busy / wall:.1%} busy; overlapping streams can "
                             f"exceed 100%)\n{table}\n\nby host time\n{cpu}\n\n{gaps}\n")
                trace = os.environ.get("REPROTUNE_PROFILE_TRACE")
                if trace:  # a Chrome trace for a closer look (large: only when asked)
                    self.prof.export_chrome_trace(trace)
                log.info("profile of steps %s written to %s", steps, out_table)
                self.prof = None

    return Profile()


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _innermost(event: Any, at: float) -> Any:
    """The deepest child of a host op whose interval holds the time `at`."""
    for child in getattr(event, "cpu_children", []) or []:
        if child.time_range.start <= at <= child.time_range.end:
            return _innermost(child, at)
    return event


def idle_gaps_report(events: Any, top: int = 25, min_us: float = 5.0) -> str:
    """Where the GPU waits: the idle time between its kernels and copies (merged over streams) in the profiled
    window, by what the host was doing when each gap began: the outermost and innermost op then running (on the
    thread that started one last: the Python thread, or autograd's in backward), or the op last finished when
    none ran (Python between ops; after a synchronisation, the host catching up)."""
    import bisect
    from collections import Counter, defaultdict

    device = [e for e in events if e.device_type.name == "CUDA"]
    host = [e for e in events if e.device_type.name == "CPU" and not getattr(e, "is_async", False)]
    if not device or not host:
        return "idle gaps: no device events recorded"
    busy = _merged([(e.time_range.start, e.time_range.end) for e in device])
    threads: dict[Any, list[Any]] = defaultdict(list)
    for e in host:
        if e.cpu_parent is None:
            threads[e.thread].append(e)
    for tops in threads.values():
        tops.sort(key=lambda e: e.time_range.start)
    starts = {t: [e.time_range.start for e in tops] for t, tops in threads.items()}

    def cause(at: float) -> tuple[str, str]:
        running, finished = [], []
        for t, tops in threads.items():
            i = bisect.bisect_right(starts[t], at) - 1
            if i >= 0:
                (running if tops[i].time_range.end >= at else finished).append(tops[i])
        if running:
            op = max(running, key=lambda e: e.time_range.start)
            return op.name, _innermost(op, at).name
        last = max(finished, key=lambda e: e.time_range.end).name if finished else ""
        return "(python, between ops)", f"after {last}"

    by_cause: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    sizes: Counter = Counter()
    total = 0.0
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:], strict=False):
        gap = gap_end - gap_start
        if gap < min_us:
            continue
        total += gap
        sizes["< 50 us" if gap < 50 else "50 us - 1 ms" if gap < 1000 else ">= 1 ms"] += gap
        key = cause(gap_start)
        by_cause[key][0] += gap
        by_cause[key][1] += 1
    span = busy[-1][1] - busy[0][0]
    lines = [f"GPU idle gaps >= {min_us:g} us: {total / 1e3:.1f} ms of {span / 1e3:.1f} ms "
             f"({total / span:.1%}); by gap size: " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sizes.items()),
             f"{'idle ms':>9} {'gaps':>6}  host op when the gap began (outermost | innermost)"]
    for (outer, inner), (us, n) in sorted(by_cause.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{us / 1e3:9.1f} {n:6d}  {outer[:60]} | {inner[:60]}")
    return "\n".join(lines)
