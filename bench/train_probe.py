"""Run `reprotune.train` in this process with a probe around it (GPU work of issue #26's speed figures).

    python bench/train_probe.py --memory-peak -- objective=dpo model=qwen3_8b_random ...   # what is live at the peak
    python bench/train_probe.py --liger-off rope,swiglu -- objective=dpo ...               # Liger without some kernels
    python bench/train_probe.py --trl-host-path -- objective=dpo ...                       # TRL's adapter switch
    python bench/train_probe.py --cpu-profile 25 -- hardware.num_threads=2 ...              # where CPU time goes

--memory-peak records every CUDA allocation from the start (torch.cuda.memory._record_memory_history), replays
them after training and prints the allocations live at the peak, summed by where they were made (the innermost
frame in reprotune, TRL, PEFT, transformers, Liger or torch.utils.checkpoint), largest first.
--trl-host-path: TRL's reference-adapter switch and the Trainer's per-micro-step FLOPs count as TRL and transformers
have them (reprotune.preference.trainers.light_use_adapter and its cached count off).
--cpu-profile N: torch.profiler over the whole run (CPU activities), the N ops with the most self CPU time; run it
once with the default (pinned) kernels and once with hardware.cpu_kernels=native to see where pinned mode's time goes.
--liger-off: the Liger kernels (Liger's own names: rope, swiglu, rms_norm) to leave out of train's apply_liger.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

LIBS = ("reprotune/", "trl/", "peft/", "transformers/", "liger_kernel/", "torch/utils/checkpoint", "torch/optim")


def where(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(lib in name for lib in LIBS):
            short = name.split("site-packages/")[-1].split("src/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(other)"


def live_at_peak(snapshot: dict) -> tuple[int, dict[str, list[int]]]:
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, peak_live = total, dict(live)
        elif action == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in peak_live.values():
        groups[site][0] += size
        groups[site][1] += 1
    return peak, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-peak", action="store_true")
    parser.add_argument("--liger-off", default="")
    parser.add_argument("--trl-host-path", action="store_true",
                        help="TRL's use_adapter and the Trainer's FLOPs count as they are (the A/B of the light ones)")
    parser.add_argument("--cpu-profile", type=int, default=0, metavar="N")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    importlib.import_module("reprotune")  # pins the CPU kernels from the command line before torch loads
    import torch

    from reprotune import train

    if args.liger_off:
        off = {name: False for name in args.liger_off.split(",")}

        def apply_liger(model, active, norm="liger"):
            if active:
                from transformers.integrations.liger import apply_liger_kernel

                apply_liger_kernel(model, {"fused_linear_cross_entropy": False, "rms_norm": norm == "liger", **off})
                if norm == "torch":
                    train.use_torch_rms_norm(model)
        train.apply_liger = apply_liger
    if args.trl_host_path:
        from reprotune.preference import trainers

        trainers.TRL_HOST_PATH = True
    if args.memory_peak:
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    sys.argv = ["reprotune.train", *args.overrides]
    profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                if args.cpu_profile else None)
    try:
        if profiler:
            with profiler:
                train.main()
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.cpu_profile))
            print(profiler.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                                         row_limit=args.cpu_profile))
        else:
            train.main()
    finally:
        if args.memory_peak:
            peak, groups = live_at_peak(torch.cuda.memory._snapshot())
            print(f"\npeak allocated (replayed from the trace): {peak / 2**30:.2f} GiB; live at the peak, by site:")
            print("| GiB | tensors | site |\n|---|---|---|")
            for site, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:30]:
                print(f"| {size / 2**30:.3f} | {count} | {site} |")


if __name__ == "__main__":
    main()
