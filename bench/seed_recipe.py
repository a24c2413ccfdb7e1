"""The seed guide's recipe (plain TRL + PEFT) against `reprotune.train` on the same data, in one invocation.

    python bench/seed_recipe.py                                  # Qwen3-8B (real architecture), LoRA and QLoRA
    python bench/seed_recipe.py --model llama_shape_8b_random    # the Llama-block 8B shape measured before #25
    python bench/seed_recipe.py --runs seed:lora ours:lora --steps 20 -- model.random_init.tokenizer_dir=/tok
    python bench/seed_recipe.py --runs ours:lora ours:lora@8x2     # @RxA: R rows per micro-batch x A accumulation
    python bench/seed_recipe.py --runs ours:lora ours:lora#2 ours:lora+strict   # #N: a repeat; +strict: repro=strict

(a) `seed:*` is the guide's train.py (../shared/seeds, guide-private-qlora) written as plain TRL code: SFTTrainer,
    LoRA r16 alpha 32 dropout 0.05 on all linear layers, batch 4 x grad-accum 4, max_length 2048, bf16, TRL's
    default gradient checkpointing, and the same with 4-bit NF4 (double quantisation) for `seed:qlora`.
(b) `ours:*` is `python -m reprotune.train` with its GPU defaults (hardware=gpu), the same batch (4 x 4), learning
    rate and data.
Data: 2,000 chat examples of 214-1,056 tokens (mean ~657), generated deterministically here (seed-shaped: the
guide's "small session"). Each run is its own process; the table gives steady tokens/s (optimizer steps after
the first two), whole-run tokens/s, MFU against the H200's measured 790 TFLOP/s bf16, peak GPU memory
(allocated / reserved), the loss at the last step, and the ratio to the seed recipe with the same method.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SYSTEM = "You are a careful assistant for an internal knowledge base. Answer in the house style."
SYLLABLES = ["ka", "lo", "ren", "tu", "mi", "sal", "dor", "ve", "pa", "qui", "nor", "tes", "bri", "an", "os",
             "el", "gra", "fen", "lu", "mar", "zo", "cel", "dis", "po", "ri", "ven", "tal", "sha", "um", "ix"]


def _words(rng: random.Random, n: int) -> str:
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    for i in range(0, n, rng.randint(9, 15)):
        words[i] = words[i].capitalize()
        if i:
            words[i - 1] += "."
    return " ".join(words) + "."


def _n_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def seed_shaped_examples(tokenizer, n: int = 2000, seed: int = 0, lo: int = 214, hi: int = 1056) -> list[dict]:
    """n chat examples whose rendered length (chat template) spans lo..hi tokens, mean ~657."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        target = lo + int((hi - lo) * rng.random() ** 0.9)  # E[u^0.9] = 0.526 -> mean ~657
        user_share = rng.uniform(0.25, 0.5)
        user = _words(rng, max(8, int(target * user_share / 1.6)))
        answer = _words(rng, max(8, int(target * (1 - user_share) / 1.6)))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user},
                    {"role": "assistant", "content": answer}]
        # trim the answer to the target length in tokens
        n_tok = _n_tokens(tokenizer, messages)
        if n_tok > target:
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            keep = max(4, len(ids) - (n_tok - target))
            messages[2]["content"] = tokenizer.decode(ids[:keep]).strip()
        rows.append({"messages": messages})
    return rows


def prepare(out: Path, model: str, overrides: list[str], n: int, source: Path | None = None) -> tuple[str, Path, dict]:
    """Materialise the model and write the seed-shaped data once; returns (model_dir, train.jsonl, stats)."""
    from transformers import AutoTokenizer

    from reprotune.config import compose
    from reprotune.models import resolve_model_dir

    cfg = compose([f"model={model}", *[o for o in overrides if o.startswith("model.")]])
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    release_gpu_memory()  # a random-init model is built on the GPU; the runs below must find all of it free
    data = out / "data" / "prepared" / "train.jsonl"
    tok = AutoTokenizer.from_pretrained(model_dir)
    if not data.is_file():
        rows = ([json.loads(line) for line in source.read_text().splitlines() if line.strip()] if source
                else seed_shaped_examples(tok, n))
        data.parent.mkdir(parents=True, exist_ok=True)
        tmp = data.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(data)
        (data.parent / "holdout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    lengths = [_n_tokens(tok, json.loads(line)["messages"]) for line in data.read_text().splitlines()]
    stats = {"examples": len(lengths), "min": min(lengths), "mean": sum(lengths) / len(lengths),
             "max": max(lengths)}
    return model_dir, data, stats


def release_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- (a) the seed recipe
def seed_recipe(model_dir: str, data: Path, method: str, steps: int, result: Path) -> None:
    """The guide's train.py, with the hub id replaced by the local model and max_steps set (runs in a child)."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    from reprotune import speed

    dataset = load_dataset("json", data_files=str(data), split="train")
    bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=str(result.parent / "out"), max_steps=steps, per_device_train_batch_size=4,
                     gradient_accumulation_steps=4, learning_rate=2e-4, lr_scheduler_type="cosine",
                     warmup_steps=20, max_length=2048, bf16=True, logging_steps=1, save_strategy="no",
                     model_init_kwargs={"dtype": torch.bfloat16, **({"quantization_config": bnb_config}
                                                                    if method == "qlora" else {})},
                     include_num_input_tokens_seen="non_padding", report_to=[], seed=42)
    timer = speed.step_timer_callback()
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=dataset, peft_config=peft_config,
                         callbacks=[timer])
    torch.cuda.reset_peak_memory_stats()
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steady = timer.steady_tokens_per_second()
    mean_tokens = sum(len(x) for x in trainer.train_dataset["input_ids"]) / len(trainer.train_dataset)
    flops = speed.lora_step_flops_per_token(trainer.model.config, mean_tokens, recompute=True)
    result.write_text(json.dumps({
        "tokens_per_s": trainer.state.num_input_tokens_seen / seconds, "steady_tokens_per_s": steady,
        "mfu": speed.mfu(steady, flops) if steady else None, "final_loss": losses[-1],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "steps": trainer.state.global_step,
        "tokens_seen": int(trainer.state.num_input_tokens_seen), "step_seconds": timer.step_seconds()}))


# ------------------------------------------------------------------------------------------- (b) reprotune
def ours(model: str, method: str, root: Path, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "reprotune.train", f"model={model}", f"method={method}", f"paths.root={root}",
           "hardware=gpu", "data.max_length=1100", f"train.max_steps={steps}", "train.per_device_train_batch_size=4",
           "train.gradient_accumulation_steps=4", "train.learning_rate=2e-4", "train.logging_steps=1",
           "train.save_steps=100000", "train.run.resume=never", *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    metrics = json.loads((root / "outputs/train/metrics.json").read_text())
    t = manifest["timing"]
    return {"tokens_per_s": t["tokens_per_second"], "steady_tokens_per_s": t["steady_tokens_per_second"],
            "mfu": t["mfu"], "final_loss": metrics["final_train_loss"], "peak_gib": t["peak_gpu_memory_gib"],
            "reserved_gib": t["peak_gpu_reserved_gib"], "steps": metrics["global_step"],
            "tokens_seen": metrics["tokens_seen"], "step_seconds": t["step_seconds"],
            "fast_path": manifest.get("run_settings") or manifest["fast_path"],
            "adapter_sha256": manifest["outputs"]["adapter"]["sha256"],
            "planned_peak_gib": planned_peak(root)}


def planned_peak(root: Path) -> float | None:
    """make train's preflight prediction (outputs/train/plan.json; outputs/plan.json before issue #24), to set
    next to the measured peak."""
    path = root / "outputs/train/plan.json"
    path = path if path.is_file() else root / "outputs/plan.json"
    return (json.loads(path.read_text())["memory"] or {}).get("peak_gib") if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=["seed:lora", "ours:lora", "seed:qlora", "ours:qlora"])
    parser.add_argument("--model", default="qwen3_8b_random")  # Qwen3ForCausalLM, 8.19 B, random weights
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("bench-out/seed_recipe"))
    parser.add_argument("--data", type=Path, help="a prepared train.jsonl instead of the seed-shaped data")
    parser.add_argument("--child", nargs=4, metavar=("MODEL_DIR", "DATA", "METHOD", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the reprotune runs (after --)")
    args = parser.parse_args()
    if args.child:
        model_dir, data, method, result = args.child
        seed_recipe(model_dir, Path(data), method, args.steps, Path(result))
        return

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, data, stats = prepare(args.out, args.model, args.overrides, args.examples, args.data)
    print(f"data: {stats['examples']} examples, {stats['min']}-{stats['max']} tokens, mean {stats['mean']:.0f}")
    if not args.runs:
        return
    results = {}
    for run in args.runs:
        who, method = run.split(":")
        method, _, _repeat = method.partition("#")  # ours:lora#2: the same run again (the spread between runs)
        method, _, mode = method.partition("+")  # ours:lora+strict: repro=strict
        method, _, shape = method.partition("@")  # ours:lora@8x2: 8 rows x 2 accumulation (same global batch)
        extra = [f"repro={mode}"] if mode else []
        if shape:
            rows, accum = shape.split("x")
            extra += [f"train.per_device_train_batch_size={rows}", f"train.gradient_accumulation_steps={accum}"]
        root = args.out / run.replace(":", "-").replace("@", "-").replace("+", "-").replace("#", "-")
        root.mkdir(parents=True, exist_ok=True)
        if who == "seed":
            result = root / "result.json"
            subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", model_dir, str(data),
                            method, str(result)], check=True)
            results[run] = json.loads(result.read_text())
        else:
            (root / "data").mkdir(exist_ok=True)
            if not (root / "data" / "prepared").exists():
                (root / "data" / "prepared").symlink_to(data.parent.resolve())
            results[run] = ours(args.model, method, root, args.steps, [*args.overrides, *extra])
        print(json.dumps({run: results[run]}), flush=True)
    (args.out / "results.json").write_text(json.dumps({"data": stats, "results": results}, indent=1))
    print_table(args.model, args.steps, results)


def print_table(model: str, steps: int, results: dict) -> None:
    print(f"\n{model}, {steps} optimizer steps of 16 rows (4 x 4 unless stated; packed rows for ours), "
          "H200 bf16 peak 790 TFLOP/s\n")
    print("| run | setting | tokens/s (steady) | tokens/s (whole run) | MFU | peak GiB (alloc / reserved) "
          "| planned peak GiB | loss at last step | x seed | adapter sha256 |\n|---|---|---|---|---|---|---|---|---|---|")
    for run, r in results.items():
        base = results.get("seed:" + run.split(":")[1].split("@")[0].split("+")[0].split("#")[0])
        ratio = (r["steady_tokens_per_s"] / base["steady_tokens_per_s"]) if base and base["steady_tokens_per_s"] else None
        planned = r.get("planned_peak_gib")
        print(f"| {run} | {setting(r)} | {r['steady_tokens_per_s'] or 0:,.0f} | {r['tokens_per_s']:,.0f} | "
              f"{(r['mfu'] or 0) * 100:.1f}% | {r['peak_gib']:.1f} / {r['reserved_gib']:.1f} | "
              f"{f'{planned:.1f}' if planned else '-'} | {r['final_loss']:.3f} | {f'{ratio:.2f}x' if ratio else '-'} | "
              f"{r.get('adapter_sha256', '-')[:16]} |")


def setting(r: dict) -> str:
    """rows x accumulation and checkpointing, as the run chose them (the seed recipe: 4 x 4, every layer)."""
    fp = r.get("fast_path")
    if not fp:
        return "4x4, ckpt all"
    every = fp.get("checkpoint_every_n_layers", 1)
    ckpt = "ckpt off" if not fp["activation_checkpointing"] else ("ckpt all" if every == 1 else f"ckpt 1/{every}")
    return f"{fp['per_device_train_batch_size']}x{fp['gradient_accumulation_steps']}, {ckpt}"


if __name__ == "__main__":
    main()
