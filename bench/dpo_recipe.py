"""Plain TRL DPO (the seed guide's style) against `reprotune.train objective=dpo` on the same pairs, in one
invocation (issue #26).

    python bench/dpo_recipe.py                                   # Qwen3-8B (real architecture), LoRA and QLoRA
    python bench/dpo_recipe.py --runs trl:lora ours:lora --steps 8 -- model.random_init.tokenizer_dir=/tok
    python bench/dpo_recipe.py --runs ours:lora+strict ours:lora+strict#2        # repro=strict, twice
    python bench/dpo_recipe.py --runs ours:lora@orpo ours:qlora@kto             # another objective, same pairs
    python bench/dpo_recipe.py --runs ours:lora ours:lora~hardware.norm_kernel=torch   # one run's own overrides
    python bench/dpo_recipe.py --runs ours:lora ours:lora^trl-host-path           # through train_probe.py --trl-host-path

(a) `trl:*`: trl.DPOTrainer as a plain script would write it: LoRA r16 alpha 32 dropout 0.05 on all linear
    layers, batch 4 x grad-accum 4 pairs, max_length 2048, gradient checkpointing, bf16, the reference = the base
    with the adapter disabled (TRL's default for a PEFT model); `trl:qlora` the same on 4-bit NF4.
(b) `ours:*`: `python -m reprotune.train objective=dpo` with its GPU defaults (hardware=gpu), the same pairs, batch,
    learning rate and beta; `ours:<method>@orpo` / `@kto` trains that objective instead (ORPO's pairs are packed too;
    KTO's rows are packed on the GPU, `~train.packing=false` gives TRL's padded batch; KTO unpairs each pair into
    two examples, so its 16 examples a step are 8 pairs' sequences).
Data: 400 seed-shaped pairs (bench/seed_recipe.py's examples: the system and user turns are the prompt, the
answer is chosen, a same-length answer of other words rejected); a pair's tokens are counted as the issue does,
prompt twice: prompt + chosen + prompt + rejected (mean ~1,300). Tokens/s = 16 pairs' tokens per optimizer step
over the steady steps' mean time (steps after the first two), the same count for both; MFU counts the policy's
forward and backward and the reference forward (reprotune.speed).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from seed_recipe import _n_tokens, _words, release_gpu_memory, seed_shaped_examples  # noqa: E402

PAIRS_PER_STEP = 16  # 4 pairs x 4 accumulation, both recipes


def seed_shaped_pairs(tokenizer, n: int = 400, seed: int = 0) -> list[dict]:
    """TRL's conversational pairs: prompt = system + user turn, chosen = the example's answer, rejected = an
    answer of about the same length in other words."""
    rng = random.Random(seed + 1)
    pairs = []
    for ex in seed_shaped_examples(tokenizer, n, seed):
        *prompt, answer = ex["messages"]
        n_answer = len(tokenizer(answer["content"], add_special_tokens=False)["input_ids"])
        other = tokenizer(_words(rng, n_answer), add_special_tokens=False)["input_ids"][:n_answer]
        pairs.append({"prompt": prompt, "chosen": [answer],
                      "rejected": [{"role": "assistant", "content": tokenizer.decode(other).strip()}]})
    return pairs


def pair_tokens(tokenizer, pair: dict) -> int:
    """prompt + chosen + prompt + rejected, with the chat template (the issue's count)."""
    return (_n_tokens(tokenizer, pair["prompt"] + pair["chosen"])
            + _n_tokens(tokenizer, pair["prompt"] + pair["rejected"]))


def prepare(out: Path, model: str, overrides: list[str], n: int) -> tuple[str, Path, dict]:
    from transformers import AutoTokenizer

    from reprotune.config import compose
    from reprotune.models import resolve_model_dir

    cfg = compose([f"model={model}", *[o for o in overrides if o.startswith("model.")]])
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    release_gpu_memory()
    data = out / "data" / "prepared" / "train.jsonl"
    tok = AutoTokenizer.from_pretrained(model_dir)
    if not data.is_file():
        pairs = seed_shaped_pairs(tok, n)
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        (data.parent / "holdout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[:8]))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    lengths = [pair_tokens(tok, row) for row in rows]
    packed = write_report(data.parent, tok, rows, str(cfg.model.name))
    return model_dir, data, {"pairs": len(lengths), "min": min(lengths), "max": max(lengths),
                             "mean": sum(lengths) / len(lengths), "packed_mean": packed}


def write_report(prepared: Path, tokenizer, rows: list[dict], model: str) -> float:
    """The token counts `make prepare` writes for pairs (report.json), so the preflight plans these pairs as it
    would prepared ones; returns the mean packed pair (the prompt once and both answers)."""
    from reprotune.preference import PAIR_LENGTHS_FILE
    from reprotune.preference.pairs import lengths_bytes, sequence_lengths
    from reprotune.prepare_report import distribution

    measured = [sequence_lengths(tokenizer, row) for row in rows]
    packed = [m[1] for m in measured]
    report = {"max_length": 2048, "pairs": {"overlong": {"policy": "drop", "dropped": 0}},
              "tokens": {"model": model, "longest_sequence_of_pair": True,
                         "train": distribution([m[0] for m in measured]), "packed_pair_train": distribution(packed),
                         "answer_share_train": round(sum(m[2] for m in measured) / sum(packed), 4)}}
    report["pairs"]["paired"] = True  # KTO unpairs each into two examples (reprotune.sizing.shape)
    (prepared / "report.json").write_text(json.dumps(report, indent=1))
    (prepared / PAIR_LENGTHS_FILE).write_bytes(lengths_bytes(packed))  # the plan sizes the drawn micro-batches
    return sum(packed) / len(packed)


# forwards without gradients per sequence trained: DPO's reference; none for ORPO; KTO's reference and its KL
# batch through the policy and the reference (trl/trainer/kto_trainer.py)
NO_GRAD_FORWARDS = {"dpo": 1, "orpo": 0, "kto": 3}


def dpo_flops_per_token(model_config, mean_sequence_tokens: float, recompute: float, no_grad_forwards: int = 1) -> float:
    """The policy's LoRA step plus the forwards without gradients (the reference's: dense and attention), per
    token."""
    from reprotune import speed

    forward = speed.matmul_flops_per_token(model_config) + speed.attention_flops_per_token(model_config,
                                                                                          mean_sequence_tokens)
    return speed.lora_step_flops_per_token(model_config, mean_sequence_tokens, recompute) + no_grad_forwards * forward


def steady(step_seconds: list[float], mean_pair_tokens: float) -> float | None:
    kept = step_seconds[2:]
    return PAIRS_PER_STEP * mean_pair_tokens / (sum(kept) / len(kept)) if kept else None


# --------------------------------------------------------------------------------------------- (a) plain TRL
def trl_recipe(model_dir: str, data: Path, method: str, steps: int, result: Path) -> None:
    import time

    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import DPOConfig, DPOTrainer

    from reprotune import speed

    dataset = load_dataset("json", data_files=str(data), split="train")
    quant = ({"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                        bnb_4bit_compute_dtype=torch.bfloat16,
                                                        bnb_4bit_use_double_quant=True)} if method == "qlora" else {})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map={"": 0}, **quant)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    args = DPOConfig(output_dir=str(result.parent / "out"), max_steps=steps, per_device_train_batch_size=4,
                     gradient_accumulation_steps=4, learning_rate=5e-5, beta=0.1, max_length=2048,
                     gradient_checkpointing=True, bf16=True, logging_steps=1, save_strategy="no", report_to=[],
                     seed=42)
    timer = speed.step_timer_callback()
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, peft_config=peft_config,
                         processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer])
    torch.cuda.reset_peak_memory_stats()
    started = time.time()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result.write_text(json.dumps({
        "seconds": time.time() - started, "final_loss": losses[-1], "step_seconds": timer.step_seconds(),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "steps": trainer.state.global_step,
        "recompute": 1.0}))


# ------------------------------------------------------------------------------------------- (b) reprotune
def ours(model: str, method: str, root: Path, steps: int, overrides: list[str], objective: str = "dpo",
         probe: str = "") -> dict:
    # a fresh adapter, reference = the base with it disabled (as the TRL recipe); a preference run reads its pairs
    # from paths.pairs and writes under paths.pref (conf/objective/paths/preference.yaml)
    launcher = ([sys.executable, str(REPO / "bench/train_probe.py"), f"--{probe}", "--"] if probe
                else [sys.executable, "-m", "reprotune.train"])
    cmd = [*launcher, f"objective={objective}", "objective.init_adapter=null",
           f"model={model}", f"method={method}",
           f"paths.root={root}", "hardware=gpu", "data.max_length=2048", f"train.max_steps={steps}",
           "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=4",
           "train.learning_rate=5e-5", "objective.beta=0.1",
           # the objective group's own max_steps/learning_rate win over train.* (dpo.yaml's are the built-in demo's)
           f"++objective.max_steps={steps}", "++objective.learning_rate=5e-5",
           *(["objective.loss_type=[sigmoid]", "objective.loss_weights=null"] if objective == "dpo" else []),
           "train.logging_steps=1", "train.save_steps=100000", "train.run.resume=never", *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    manifest = json.loads((root / "outputs/pref/train/manifest.json").read_text())
    metrics = json.loads((root / "outputs/pref/train/metrics.json").read_text())
    t, rs = manifest["timing"], manifest["run_settings"]
    recompute = 0.0 if not rs["activation_checkpointing"] else 1.0 / rs["checkpoint_every_n_layers"]
    return {"final_loss": metrics["final_train_loss"], "step_seconds": t["step_seconds"],
            "peak_gib": t["peak_gpu_memory_gib"], "reserved_gib": t["peak_gpu_reserved_gib"],
            "steps": metrics["global_step"], "recompute": recompute, "run_settings": rs,
            "adapter_sha256": manifest["outputs"]["adapter"]["sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=["trl:lora", "ours:lora", "trl:qlora", "ours:qlora"])
    parser.add_argument("--model", default="qwen3_8b_random")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("bench-out/dpo_recipe"))
    parser.add_argument("--child", nargs=4, metavar=("MODEL_DIR", "DATA", "METHOD", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the reprotune runs (after --)")
    args = parser.parse_args()
    if args.child:
        model_dir, data, method, result = args.child
        trl_recipe(model_dir, Path(data), method, args.steps, Path(result))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, data, stats = prepare(args.out, args.model, args.overrides, args.pairs)
    print(f"data: {stats['pairs']} pairs, {stats['min']}-{stats['max']} tokens (prompt twice), mean {stats['mean']:.0f}")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    results = {}
    for run in args.runs:
        who, spec = run.split(":", 1)
        spec, *run_overrides = spec.split("~")  # ours:lora~hardware.norm_kernel=torch: this run's own overrides
        spec, _, probe = spec.partition("^")  # ours:lora^trl-host-path: through bench/train_probe.py with that flag
        spec, _, _repeat = spec.partition("#")
        spec, _, objective = spec.partition("@")  # ours:lora@orpo: another objective (default dpo)
        objective = objective or "dpo"
        if who == "trl" and objective != "dpo":
            raise SystemExit(f"{run}: the plain TRL recipe is DPO's; name another objective on ours: runs")
        method, _, mode = spec.partition("+")
        root = args.out / "".join(ch if ch.isalnum() or ch in "._" else "-" for ch in run)
        root.mkdir(parents=True, exist_ok=True)
        try:
            if who == "trl":
                result = root / "result.json"
                subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", model_dir, str(data),
                                method, str(result)], check=True)
                r = json.loads(result.read_text())
            else:
                (root / "data").mkdir(exist_ok=True)
                if not (root / "data" / "pairs").exists():
                    (root / "data" / "pairs").symlink_to(data.parent.resolve())
                r = ours(args.model, method, root, args.steps, [*args.overrides, *([f"repro={mode}"] if mode else []), *run_overrides],
                         objective, probe)
        except subprocess.CalledProcessError as err:
            r = {"failed": err.returncode}
        if "failed" not in r:
            r["objective"] = objective
            # a step's tokens: 16 pairs' (prompt twice), KTO's 16 examples one sequence each
            per_example = stats["mean"] / 2 if objective == "kto" else stats["mean"]
            r["steady_tokens_per_s"] = steady(r["step_seconds"], per_example)
            ng = NO_GRAD_FORWARDS[objective]
            flops = dpo_flops_per_token(config, stats["mean"] / 2, r["recompute"], ng)
            from reprotune import speed

            r["mfu"] = speed.mfu(r["steady_tokens_per_s"], flops) if r["steady_tokens_per_s"] else None
            # the GPU's own rate: packed pairs compute each prompt once (a counted token is then fewer FLOPs)
            computed = stats["packed_mean"] if r.get("run_settings", {}).get("packing") else stats["mean"]
            r["mfu_computed"] = (speed.mfu(r["steady_tokens_per_s"] * computed / stats["mean"],
                                           dpo_flops_per_token(config, computed / 2, r["recompute"], ng))
                                 if r["steady_tokens_per_s"] else None)
        results[run] = r
        print(json.dumps({run: r}), flush=True)
        (args.out / "results.json").write_text(json.dumps({"data": stats, "results": results}, indent=1))
    print_table(args.model, args.steps, stats, results)


def print_table(model: str, steps: int, stats: dict, results: dict) -> None:
    objectives = "/".join(sorted({r.get("objective", "dpo").upper() for r in results.values()})) or "DPO"
    print(f"\n{model}, {objectives}, {steps} optimizer steps of 16 pairs (4 x 4; KTO: 16 examples), {stats['pairs']} pairs of mean "
          f"{stats['mean']:.0f} tokens (prompt twice)\n")
    print(f"MFU counts the issue's tokens (prompt twice); 'computed' counts what ran (packed pairs: the prompt once, "
          f"mean {stats['packed_mean']:.0f} tokens a pair)\n")
    print("| run | tokens/s (steady) | MFU | MFU computed | peak GiB (alloc / reserved) | loss at last step | x TRL |"
          " settings | adapter sha256 |\n|---|---|---|---|---|---|---|---|---|")
    for run, r in results.items():
        if "failed" in r:
            print(f"| {run} | failed (exit {r['failed']}) | | | | | | | |")
            continue
        base = (results.get("trl:" + run.split(":", 1)[1].split("~")[0].split("+")[0].split("#")[0].split("@")[0]) or {}
                if r.get("objective", "dpo") == "dpo" else {})  # the TRL recipe is DPO's
        ratio = (r["steady_tokens_per_s"] / base["steady_tokens_per_s"]
                 if base.get("steady_tokens_per_s") and r["steady_tokens_per_s"] else None)
        rs = r.get("run_settings")
        setting = (f"{rs['per_device_train_batch_size']}x{rs['gradient_accumulation_steps']}, ckpt "
                   f"{'every ' + str(rs['checkpoint_every_n_layers']) if rs['activation_checkpointing'] else 'off'}, "
                   f"{rs['attn_implementation']}, norm {rs.get('norm_kernel', 'liger' if rs['liger'] else 'eager')}"
                   f"{', embedding on host' if rs.get('embedding_on_host') else ''}" if rs else "4x4, ckpt every layer, sdpa, padded")
        print(f"| {run} | {r['steady_tokens_per_s'] or 0:,.0f} | {(r['mfu'] or 0) * 100:.1f}% | "
              f"{(r.get('mfu_computed') or 0) * 100:.1f}% | "
              f"{r['peak_gib']:.2f} / {r['reserved_gib']:.2f} | {r['final_loss']:.4f} | "
              f"{f'{ratio:.2f}x' if ratio else '-'} | {setting} | {r.get('adapter_sha256', '-')[:16]} |")


if __name__ == "__main__":
    main()
