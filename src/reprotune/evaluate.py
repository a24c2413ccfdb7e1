"""Eval stage: the holdout through the base model and the fine-tuned one, side by side.

    python -m reprotune.evaluate [hydra overrides]      # == make eval ARGS="..."

"Before shutting the machine down, run your held-out examples through the base model and the tuned one
and compare them side by side." Optionally also through a prompt-only baseline (any OpenAI-compatible
endpoint, eval.baseline.url): if a well-prompted base model is almost as good, fine-tuning was not needed.

Reads  data/prepared/holdout.jsonl, the base model, outputs/adapter/ (PEFT adapter, tokenizer, chat template).
Writes outputs/eval/metrics.json (deterministic: no timings), predictions.jsonl (every example, every
       system), report.md (summary table, then the examples where base and tuned differ, worst regressions
       first), comparison.png (per-metric bars) and manifest.json (provenance and timings).
       All five are written into <eval_dir>.tmp and renamed in together (write_outputs): one set or the old one.

Both local systems use one loaded model (the adapter switched off for the base pass), one tokenizer, the
adapter's chat template, greedy decoding and the same generation settings, batched with left padding.

Read top to bottom: settings -> data -> model -> generate / loss -> baseline -> score -> report.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from reprotune import metrics as mx
from reprotune import varlen_attention
from reprotune.config import CONF_DIR, quantization
from reprotune.errors import ReprotuneError, user_errors
from reprotune.io import atomic_write_text, fresh_dir, iter_jsonl, jsonl_text, replace_all, save_figure
from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
from reprotune.preference import is_preference, pair_eval, route_paths
from reprotune.runtime import attention, resolve_device, resolve_dtype, set_reproducibility

log = logging.getLogger("reprotune.evaluate")

SYSTEM_LABELS = {"base": "base", "sft": "SFT adapter (start)", "tuned": "tuned", "baseline": "prompt baseline"}
# the order of the systems in metrics.json, report.md and comparison.png (sft: a preference run's start adapter)
SYSTEMS = ("base", "sft", "tuned", "baseline")
LOWER_IS_BETTER = {"loss", "perplexity"}
# Padded generation keeps a (batch x length) KV cache and logits; these are safe starting points for a
# laptop CPU and for one GPU. Override with eval.batch_size=N.
AUTO_BATCH_SIZE = {"cpu": 8, "cuda": 32}
OUTPUT_FILES = {"metrics": "metrics.json", "predictions": "predictions.jsonl", "report": "report.md",
                "comparison_plot": "comparison.png"}
MANIFEST_FILE = "manifest.json"


# ----------------------------------------------------------------------------------------------- settings
def resolve_batch_size(cfg: DictConfig, device: str) -> int:
    size = cfg.eval.batch_size
    if size == "auto":
        return AUTO_BATCH_SIZE.get(device, 8)
    if not isinstance(size, int) or size < 1:
        raise ReprotuneError(f"eval.batch_size: must be a positive integer or 'auto', not {size!r}")
    return size


# ------------------------------------------------------------------------------------------------- data
@dataclass
class Example:
    index: int                      # line order in the holdout file
    prompt: list[dict[str, str]] | str  # every message but the last (assistant) one; a text preference row's prompt
    reference: str                  # the last assistant message
    row: int | None = None          # a preference holdout: the row it comes from (KTO: only label-true rows)
    where: str = ""                 # file:line: field of the reference, for a message about it


def read_holdout(path: Path, max_examples: int | None = None) -> list[Example]:
    """Validate while reading: a bad line is reported by file, line number and field. A preference holdout's
    rows are examples too: a pair's chosen answer, a KTO row's completion when its label is true, is the reference
    (a label-false row has none); text (standard) rows keep their text prompt; max_examples counts rows."""
    examples: list[Example] = []
    rows = 0
    for lineno, row in iter_jsonl(path, "run 'make prepare' first"):
        where = f"{path}:{lineno}"
        rows += 1
        messages = row.get("messages") if isinstance(row, dict) else None
        kind = pair_eval.row_kind(row) if messages is None else None
        text = bool(kind) and isinstance(row["prompt"], str)
        if examples and text != isinstance(examples[-1].prompt, str):
            raise ReprotuneError(f"{where}: prompt: mixes text (standard) rows and message rows; one holdout holds "
                                 "one kind")
        if text:  # trained on raw text: asked the same way
            if kind == "pairs" or row["label"]:
                answer = "chosen" if kind == "pairs" else "completion"
                examples.append(Example(len(examples), row["prompt"], row[answer], rows - 1, f"{where}: {answer}"))
            if max_examples and rows >= max_examples:
                break
            continue
        if kind == "pairs":
            messages = [*row["prompt"], *row["chosen"]]  # a preference pair: the chosen answer is the reference
        elif kind == "kto" and not row["label"]:
            if max_examples and rows >= max_examples:
                break
            continue  # an undesirable completion is no reference
        elif kind == "kto":
            messages = [*row["prompt"], *row["completion"]]
        if not isinstance(messages, list) or len(messages) < 2:
            raise ReprotuneError(f"{where}: messages: must be a list of at least 2 messages")
        for i, msg in enumerate(messages):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                    and isinstance(msg.get("content"), str)):
                raise ReprotuneError(f"{where}: messages[{i}]: needs string 'role' and 'content'")
        if messages[-1]["role"] != "assistant":
            raise ReprotuneError(f"{where}: messages[-1].role: must be 'assistant' (the reference)")
        field = {"pairs": "chosen[-1].content", "kto": "completion[-1].content"}.get(kind, "messages[-1].content")
        examples.append(Example(len(examples), messages[:-1], messages[-1]["content"], rows - 1 if kind else None,
                                f"{where}: {field}"))
        if max_examples and rows >= max_examples:
            break
    if not examples:
        raise ReprotuneError(f"{path}:1: file: holds no examples")
    return examples


def check_references(examples: Sequence[Example], task: dict) -> None:
    """A json task's references must be JSON objects, or every score would be meaningless."""
    if task["type"] != "json":
        return
    for ex in examples:
        if mx.parse_json_object(ex.reference) is None:
            raise ReprotuneError(f"{ex.where}: the reference answer is not a JSON object, but data.task.type is json; "
                                 "for free-text answers set data.task.type=text (or auto: inferred from the answers)")


def builtin_data(cfg: DictConfig) -> bool:
    """The run's data is the built-in invoice file (whose task conf/data/invoices.yaml describes)."""
    return mx.is_builtin_data(str(cfg.data.path), str(cfg.paths.raw))


# the room an answer gets beyond the longest training answer: tokens, and a fraction of its length
ANSWER_MARGIN, ANSWER_MARGIN_FRACTION = 16, 0.25


def answer_budget(cfg: DictConfig) -> int:
    """eval.max_new_tokens auto: the longest reference answer of the train split, in the adapter's tokenizer, plus
    its end-of-turn tokens and a margin (a 10-token answer is no reason to let a rambling base run 128 tokens)."""
    train_file = Path(cfg.paths.prepared) / "train.jsonl"
    adapter_dir = Path(cfg.paths.adapter)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ReprotuneError(f"{adapter_dir / 'adapter_config.json'}: file: not found; run 'make train' first")
    tokenizer = load_tokenizer(adapter_dir)
    answers = read_holdout(train_file)  # the same reader: its last assistant turn (a pair's chosen) is the answer
    longest = max(len(tokenizer.encode(ex.reference, add_special_tokens=False)) + len(end_of_turn_ids(tokenizer, ex))
                  for ex in answers)
    return longest + max(ANSWER_MARGIN, math.ceil(ANSWER_MARGIN_FRACTION * longest))


def settle_task(cfg: DictConfig, examples: Sequence[Example]) -> dict[str, Any]:
    """data.task and eval.max_new_tokens as this run uses them, written back into cfg (the report and the manifest
    say what was used): the task type from the reference answers (metrics.resolve_task), the generation budget from
    the training answers (answer_budget). A value set explicitly wins; a wrong one is one line naming the setting."""
    task = mx.run_task(OmegaConf.to_container(cfg.data.task, resolve=True), [ex.reference for ex in examples],
                       str(cfg.data.path), str(cfg.paths.raw))
    check_references(examples, task)
    budget = cfg.eval.max_new_tokens
    if budget == "auto":
        budget = answer_budget(cfg)
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ReprotuneError(f"eval.max_new_tokens: {budget!r} is not a positive integer or auto")
    with open_dict(cfg):
        cfg.data.task = task
        cfg.eval.max_new_tokens = int(budget)
    log.info("eval: task %s (metrics %s), max_new_tokens %d", task["type"], ", ".join(mx.metric_names(task)), budget)
    return task


# ------------------------------------------------------------------------------------------------ model
def load_model_and_tokenizer(cfg: DictConfig, device: str, dtype: str):
    """The base model once, with the adapter on top: disable_adapter() gives the base back for its pass."""
    from peft import PeftModel

    adapter_dir = Path(cfg.paths.adapter)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ReprotuneError(f"{adapter_dir / 'adapter_config.json'}: file: not found; run 'make train' first")
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    # the adapter directory carries the exact tokenizer and chat template the adapter was trained with
    tokenizer = load_tokenizer(adapter_dir)
    attn = attention(cfg, packing=False, device=device)
    varlen_attention.register_if_chosen(attn)  # only when hardware.attn_implementation names it
    base = load_base_model(model_dir, cfg, device, dtype, attn)
    if not quantization(cfg):
        base = base.to(device)
    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    return model, tokenizer, model_dir


def end_of_turn_ids(tokenizer, example: Example) -> list[int]:
    """What the template puts after an assistant reply (e.g. <|im_end|>): the tokens a good answer ends with. A text
    answer ends with the EOS, which TRL appends to each text answer."""
    if isinstance(example.prompt, str):
        return [tokenizer.eos_token_id]
    full = tokenizer.apply_chat_template([*example.prompt, {"role": "assistant", "content": example.reference}],
                                         tokenize=False)
    prompt = tokenizer.apply_chat_template(example.prompt, tokenize=False, add_generation_prompt=True)
    rest = full[len(prompt):] if full.startswith(prompt) else ""
    suffix = rest[len(example.reference):].rstrip() if rest.startswith(example.reference) else ""
    if suffix:
        return tokenizer.encode(suffix, add_special_tokens=False)
    return [tokenizer.eos_token_id]


def encode_prompts(tokenizer, examples: Sequence[Example]) -> list[list[int]]:
    """Each prompt's ids: rendered with the chat template and its generation prompt (which already holds any BOS
    the model needs); a text prompt tokenized as TRL tokenizes one (the tokenizer's own special tokens)."""
    return [list(tokenizer(text=ex.prompt)["input_ids"]) if isinstance(ex.prompt, str) else
            tokenizer.encode(tokenizer.apply_chat_template(ex.prompt, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)
            for ex in examples]


def batches(order: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(order), size):
        yield list(order[start:start + size])


def pad(rows: Sequence[Sequence[int]], pad_id: int, side: str):
    """(input_ids, attention_mask) tensors; left padding for generation, right padding for scoring."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------- generate / loss
@dataclass
class SystemRun:
    """One system's outputs on the holdout, in holdout order."""
    predictions: list[str]
    new_tokens: list[int]
    nll: list[float] = field(default_factory=list)     # summed loss over each reference's tokens
    n_tokens: list[int] = field(default_factory=list)  # how many reference tokens that is
    seconds: float = 0.0


def generate_all(model, tokenizer, prompt_ids: list[list[int]], batch_size: int, max_new_tokens: int,
                 desc: str) -> tuple[list[str], list[int]]:
    """Greedy completions, batched; longest prompts first so a too-large batch fails at once."""
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    eos = {tokenizer.eos_token_id}
    model_eos = model.generation_config.eos_token_id
    eos |= set(model_eos if isinstance(model_eos, list) else [model_eos] if model_eos is not None else [])
    gen_config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens),
                                  eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id)
    order = sorted(range(len(prompt_ids)), key=lambda i: (-len(prompt_ids[i]), i))
    texts: list[str] = [""] * len(prompt_ids)
    counts: list[int] = [0] * len(prompt_ids)
    device = next(model.parameters()).device
    for batch in tqdm(list(batches(order, batch_size)), desc=desc, unit="batch"):
        ids, mask = pad([prompt_ids[i] for i in batch], tokenizer.pad_token_id, side="left")
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=gen_config)
        new = out[:, ids.shape[1]:].cpu()
        for row, i in enumerate(batch):
            tokens = new[row].tolist()
            # tokens after the first end-of-sequence are padding
            end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
            counts[i] = end
            texts[i] = tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()
    return texts, counts


def reference_loss(model, tokenizer, examples: Sequence[Example], prompt_ids: list[list[int]],
                   batch_size: int, desc: str) -> tuple[list[float], list[int]]:
    """Summed cross-entropy of each reference reply (+ its end-of-turn tokens) given its prompt, as
    generation sees it: the prompt tokens, then the reference tokens. Only the assistant tokens count."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    targets = [tokenizer.encode(ex.reference, add_special_tokens=False) + end_of_turn_ids(tokenizer, ex)
               for ex in examples]
    rows = [p + t for p, t in zip(prompt_ids, targets, strict=True)]
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]), i))
    nll, n_tokens = [0.0] * len(rows), [0] * len(rows)
    device = next(model.parameters()).device
    for batch in tqdm(list(batches(order, batch_size)), desc=desc, unit="batch"):
        ids, mask = pad([rows[i] for i in batch], tokenizer.pad_token_id, side="right")
        labels = torch.full_like(ids, -100)
        for row, i in enumerate(batch):
            start = len(prompt_ids[i])
            labels[row, start:len(rows[i])] = ids[row, start:len(rows[i])]
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                 reduction="none")
        for row, i in enumerate(batch):
            nll[i] = float(losses[row].sum())
            n_tokens[i] = int((labels[row, 1:] != -100).sum())
    return nll, n_tokens


def run_local(model, tokenizer, examples: Sequence[Example], name: str, cfg: DictConfig,
              batch_size: int, adapter: str | None) -> SystemRun:
    """One system's task pass: adapter None = the base (adapter disabled), else the named PEFT adapter."""
    started = time.time()
    prompt_ids = encode_prompts(tokenizer, examples)
    if adapter is not None:
        model.set_adapter(adapter)
    switch = nullcontext() if adapter is not None else model.disable_adapter()
    with switch:
        texts, counts = generate_all(model, tokenizer, prompt_ids, batch_size, cfg.eval.max_new_tokens,
                                     desc=f"{name}: generate")
        run = SystemRun(texts, counts)
        if cfg.eval.loss:
            run.nll, run.n_tokens = reference_loss(model, tokenizer, examples, prompt_ids, batch_size,
                                                   desc=f"{name}: holdout loss")
    run.seconds = time.time() - started
    return run


# ----------------------------------------------------------------------------------------------- baseline
def baseline_messages(prompt: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The holdout prompt, with the configured system prompt in place of the example's own (if set)."""
    if system_prompt is None:
        return list(prompt)
    rest = prompt[1:] if prompt and prompt[0]["role"] == "system" else prompt
    return [{"role": "system", "content": system_prompt}, *rest]


def run_baseline(cfg: DictConfig, examples: Sequence[Example]) -> SystemRun:
    """The same holdout through an OpenAI-compatible chat endpoint, greedy (temperature 0); text prompts through
    its completions endpoint, as they are."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from tqdm.auto import tqdm

    b = cfg.eval.baseline
    if not b.model:
        raise ReprotuneError("eval.baseline.model: must name the model the endpoint serves")
    # local servers ignore the key but the client insists on one; a real key only ever comes from the env
    key = os.environ.get(b.api_key_env or "", "") or "no-key"
    client = openai.OpenAI(base_url=b.url, api_key=key, timeout=float(b.timeout_s), max_retries=int(b.max_retries))
    max_tokens = int(b.max_tokens or cfg.eval.max_new_tokens)

    def ask(ex: Example) -> tuple[str, int]:
        if isinstance(ex.prompt, str):
            done = client.completions.create(model=b.model, prompt=ex.prompt, temperature=0.0, max_tokens=max_tokens,
                                             seed=int(cfg.seed))
            usage = done.usage.completion_tokens if done.usage else 0
            return (done.choices[0].text or "").strip(), int(usage or 0)
        reply = client.chat.completions.create(
            model=b.model, messages=baseline_messages(ex.prompt, b.system_prompt), temperature=0.0,
            max_tokens=max_tokens, seed=int(cfg.seed))
        usage = reply.usage.completion_tokens if reply.usage else 0
        return (reply.choices[0].message.content or "").strip(), int(usage or 0)

    started = time.time()
    try:
        with ThreadPoolExecutor(max_workers=max(1, int(b.concurrency))) as pool:
            answers = list(tqdm(pool.map(ask, examples), total=len(examples), desc="prompt baseline",
                                unit="example"))
    except openai.APIConnectionError as err:
        raise ReprotuneError(f"eval.baseline.url: {b.url}: cannot connect ({err.__cause__ or err})") from None
    except openai.APIStatusError as err:
        raise ReprotuneError(f"eval.baseline.url: {b.url}: HTTP {err.status_code} for model "
                             f"{b.model!r}; check eval.baseline.model and ${b.api_key_env}") from None
    run = SystemRun([a for a, _ in answers], [n for _, n in answers])
    run.seconds = time.time() - started
    return run


# -------------------------------------------------------------------------------------------------- score
def summarise(run: SystemRun, scores: list[dict[str, float]], names: Sequence[str]) -> dict[str, float]:
    summary = mx.mean_scores(scores, names)
    if run.n_tokens:
        loss = sum(run.nll) / max(1, sum(run.n_tokens))
        summary["loss"] = loss
        summary["perplexity"] = math.exp(loss)
    return {k: round(v, 6) for k, v in summary.items()}


def build_metrics(summaries: dict[str, dict[str, float]], n_examples: int) -> dict[str, Any]:
    """metrics.json: per system, and the deltas that answer 'was it worth it' (DVC flattens the nesting)."""
    out: dict[str, Any] = {"examples": n_examples, **summaries}
    for other in ("base", "sft", "baseline"):
        if other in summaries:
            out[f"delta_tuned_vs_{other}"] = {k: round(summaries["tuned"][k] - v, 6)
                                             for k, v in summaries[other].items() if k in summaries["tuned"]}
    return out


# ------------------------------------------------------------------------------------------------- report
def _fmt(value: float | None, name: str) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if name in LOWER_IS_BETTER else f"{100 * value:.1f}%"


def _fmt_delta(value: float | None, name: str) -> str:
    if value is None:
        return "–"
    return f"{value:+.3f}" if name in LOWER_IS_BETTER else f"{100 * value:+.1f} pp"


def summary_table(metrics: dict[str, Any], names: Sequence[str]) -> str:
    systems = [s for s in SYSTEMS if s in metrics]
    others = [s for s in ("base", "sft", "baseline") if s in systems]
    header = ["metric", *(SYSTEM_LABELS[s] for s in systems), *(f"Δ tuned − {SYSTEM_LABELS[s]}" for s in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in [*names, "loss", "perplexity"]:
        if not any(name in metrics[s] for s in systems):
            continue
        label = f"{name} (lower is better)" if name in LOWER_IS_BETTER else name
        cells = [label, *(_fmt(metrics[s].get(name), name) for s in systems),
                 *(_fmt_delta(metrics[f"delta_tuned_vs_{s}"].get(name), name) for s in others)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str, limit: int = 400) -> str:
    text = text if len(text) <= limit else text[:limit] + " …"
    return "<code>" + (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                       .replace("|", "&#124;").replace("\n", "<br>")) + "</code>"


def differing_examples(records: list[dict], primary: str, limit: int) -> list[dict]:
    """Examples where base and tuned answer differently, worst regression (tuned − base) first."""
    differ = [r for r in records if r["predictions"]["base"] != r["predictions"]["tuned"]]
    differ.sort(key=lambda r: (r["scores"]["tuned"][primary] - r["scores"]["base"][primary], r["index"]))
    return differ[:limit]


def write_report(path: Path, cfg: DictConfig, metrics: dict[str, Any], records: list[dict],
                 names: Sequence[str], primary: str, note: str | None = None) -> str:
    systems = [s for s in SYSTEMS if s in metrics]
    table = summary_table(metrics, names)
    n_differ = sum(r["predictions"]["base"] != r["predictions"]["tuned"] for r in records)
    limit = int(cfg.eval.report_examples)
    shown = differing_examples(records, primary, limit)
    parts = [
        f"# Evaluation: {cfg.model.name} base vs + adapter on the {cfg.data.name} holdout",
        "",
        f"{metrics['examples']} holdout examples; greedy decoding, max {cfg.eval.max_new_tokens} new tokens, "
        f"the adapter's chat template. Task type `{cfg.data.task.type}`; the examples below are ranked by "
        f"`{primary}`.",
        "",
        table,
        "",
        *([note, ""] if note else []),
        *([f"## Holdout {'pairs' if 'pairs' in metrics['preference'] else 'KTO rows'} (objective "
           f"{cfg.objective.name}): implicit reward against the base", "",
           pair_eval.table(metrics["preference"]), ""] if "preference" in metrics else []),
        f"## Where base and tuned differ ({n_differ} of {metrics['examples']}; "
        f"{len(shown)} shown, worst regressions first)",
        "",
    ]
    for r in shown:
        s = r["scores"]
        delta = s["tuned"][primary] - s["base"][primary]
        parts += [f"### Example {r['index'] + 1}: {primary} {_fmt(s['base'][primary], primary)} → "
                  f"{_fmt(s['tuned'][primary], primary)} ({_fmt_delta(delta, primary)})", "",
                  "Input: " + _cell(r["input"], 600), "",
                  "| reference | " + " | ".join(SYSTEM_LABELS[x] for x in systems) + " |",
                  "|---|" + "---|" * len(systems),
                  "| " + " | ".join([_cell(r["reference"]), *(_cell(r["predictions"][x]) for x in systems)]) + " |",
                  ""]
    text = "\n".join(parts) + "\n"
    atomic_write_text(path, text)
    return table


def plot_comparison(metrics: dict[str, Any], names: Sequence[str], out: Path) -> None:
    """Grouped bars: rate metrics in percent; loss and perplexity (lower is better) on their own axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEMS if s in metrics]
    rates = [n for n in names if not n.startswith("field/")]
    losses = [n for n in ("loss", "perplexity") if n in metrics["base"]]
    pairs = [2] if "preference" in metrics else []  # a preference run: reward and log-prob accuracy of pairs
    fig, axes = plt.subplots(1, 1 + len(losses) + len(pairs),
                             figsize=(3 + 1.1 * len(rates) + 2 * len(losses) + 3 * len(pairs), 4), dpi=100,
                             gridspec_kw={"width_ratios": [max(2, len(rates)), *([1] * len(losses)), *pairs]},
                             squeeze=False)
    if pairs:
        pair_eval.plot_axes(axes[0][-1], metrics["preference"])
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        values = [100 * metrics[system].get(n, 0.0) for n in rates]
        bars = axes[0][0].bar([i + k * width for i in range(len(rates))], values, width,
                              label=SYSTEM_LABELS[system])
        axes[0][0].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[0][0].set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(rates))], rates, rotation=20,
                          ha="right")
    axes[0][0].set_ylabel("% of holdout examples (higher is better)")
    axes[0][0].set_ylim(0, 110)
    axes[0][0].legend(fontsize=8)
    for ax, name in zip(axes[0][1:1 + len(losses)], losses, strict=True):
        present = [s for s in systems if name in metrics[s]]
        ax.bar([SYSTEM_LABELS[s] for s in present], [metrics[s][name] for s in present],
               color=[f"C{systems.index(s)}" for s in present])
        ax.set_title(f"{name} (lower is better)", fontsize=9)
    for ax in axes[0]:
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def write_predictions(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, jsonl_text(records, sort_keys=True))


def write_outputs(out_dir: Path, root: Path, cfg: DictConfig, metrics: dict[str, Any], records: list[dict],
                  names: Sequence[str], primary: str, record: dict[str, Any], note: str | None = None) -> str:
    """Every output file, as one set: all are written into `<eval_dir>.tmp` first and renamed over the
    previous ones only once the last (the manifest, with their hashes) is there, so a failure or a kill while
    writing leaves the previous set byte for byte. DVC's declared paths stay the single files in eval_dir.
    Returns the summary table."""
    from reprotune import manifest as mf

    staged = fresh_dir(out_dir)
    write_predictions(staged / OUTPUT_FILES["predictions"], records)
    mf.write_json(staged / OUTPUT_FILES["metrics"], metrics)  # deterministic: timings go to the manifest
    if metrics["examples"]:
        table = write_report(staged / OUTPUT_FILES["report"], cfg, metrics, records, names, primary, note)
        plot_comparison(metrics, names, staged / OUTPUT_FILES["comparison_plot"])
    else:  # a preference holdout without a task pass
        table = write_preference_report(staged / OUTPUT_FILES["report"], cfg, metrics, note or "")
        plot_preference(metrics, staged / OUTPUT_FILES["comparison_plot"])
    # recorded under the paths they will have, hashed where they are now (the rename keeps the bytes)
    record["outputs"] = {key: {"path": Path(os.path.relpath(out_dir / name, root)).as_posix(),
                               "sha256": mf.sha256_file(staged / name)}
                         for key, name in OUTPUT_FILES.items()}
    mf.write_json(staged / MANIFEST_FILE, record)
    names_in_set = [*OUTPUT_FILES.values(), MANIFEST_FILE]
    replace_all({out_dir / name: staged / name for name in names_in_set})
    staged.rmdir()
    return table


def load_start_adapter(cfg: DictConfig, model) -> bool:
    """A preference run that started from an SFT adapter (objective.init_adapter): that adapter next to the trained
    one, as PEFT adapter "sft", so the task pass and the pairs' pass score it too. False when there is none."""
    init = cfg.objective.get("init_adapter") if is_preference(cfg) else None
    if not init or not (Path(str(init)) / "adapter_config.json").is_file():
        return False
    model.load_adapter(str(init), adapter_name="sft")
    model.set_adapter("default")
    return True


def preference_pass(cfg: DictConfig, model, tokenizer, rows: list[dict], with_sft: bool
                    ) -> tuple[dict[str, Any], list[dict]]:
    """A preference run's holdout rows through base, the SFT adapter it started from and the trained adapter."""
    return pair_eval.preference_eval(model, tokenizer, rows, float(cfg.objective.get("beta") or 0.1), with_sft)


def task_pass_note(rows: list[dict], examples: int) -> str:
    """What report.md says of a preference holdout's task metrics: which rows they are computed on, or why none."""
    if isinstance(rows[0]["prompt"], str) and examples:
        which = "pairs: the chosen answer" if "chosen" in rows[0] else "KTO rows with label true: their completion"
        return (f"Task metrics on the {examples} holdout text rows ({which} is the reference), each prompt given as "
                "its raw text, with no chat template, as the model was trained on it.")
    if "chosen" in rows[0]:
        return f"Task metrics on the {examples} holdout pairs: the chosen answer is the reference."
    undesirable = sum(not r["label"] for r in rows)
    if not examples:
        return (f"Task metrics: skipped. All {undesirable} KTO holdout rows have label false: an undesirable "
                "completion is no reference to score generations against.")
    return (f"Task metrics on the {examples} KTO rows with label true (their completion is the reference); the "
            f"{undesirable} rows with label false have no reference.")


def preference_holdout(cfg: DictConfig, holdout: Path) -> tuple[list[dict], list[Example]]:
    """The rows of a preference holdout, and the examples of its task pass (none for KTO rows that are all
    undesirable)."""
    rows = pair_eval.read_pairs(holdout, cfg.eval.max_examples)  # one kind in a file, checked
    wanted = "chosen" in rows[0] or any(r["label"] for r in rows)
    return rows, read_holdout(holdout, cfg.eval.max_examples) if wanted else []


def write_preference_report(path: Path, cfg: DictConfig, metrics: dict[str, Any], note: str) -> str:
    """report.md of a preference holdout without a task pass: the preference table and why the task is skipped."""
    what = "pairs" if "pairs" in metrics["preference"] else "KTO rows"
    table = pair_eval.table(metrics["preference"])
    text = "\n".join([f"# Evaluation: {cfg.model.name} base vs + adapter on the {cfg.data.name} holdout", "", note, "",
                      f"## Holdout {what} (objective {cfg.objective.name}): implicit reward against the base", "",
                      table, ""]) + "\n"
    atomic_write_text(path, text)
    return table


def plot_preference(metrics: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    pair_eval.plot_axes(ax, metrics["preference"])
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- main
def evaluate(cfg: DictConfig) -> dict[str, Any]:
    import torch

    from reprotune import manifest as mf

    started = time.time()
    route_paths(cfg)  # a preference run: data/pairs/holdout.jsonl and outputs/pref/adapter in, outputs/pref/eval out
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    set_reproducibility(cfg, device)
    batch_size = resolve_batch_size(cfg, device)

    holdout = Path(cfg.paths.prepared) / "holdout.jsonl"
    rows, examples = preference_holdout(cfg, holdout) if is_preference(cfg) else ([], None)
    if examples is None:
        examples = read_holdout(holdout, cfg.eval.max_examples)
    task = settle_task(cfg, examples)  # data.task.type auto, eval.max_new_tokens auto: from the data
    log.info("eval: %d holdout examples, device=%s dtype=%s batch_size=%d", len(examples), device, dtype,
             batch_size)

    runs: dict[str, SystemRun] = {}
    if cfg.eval.baseline.url and examples:  # first: a wrong URL or key fails in seconds, before the local passes
        runs["baseline"] = run_baseline(cfg, examples)
    model, tokenizer, model_dir = load_model_and_tokenizer(cfg, device, dtype)
    with_sft = load_start_adapter(cfg, model)
    model.eval()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if examples:
        runs["base"] = run_local(model, tokenizer, examples, "base", cfg, batch_size, adapter=None)
        if with_sft:  # did the preference step beat the adapter it started from, on the task itself?
            runs["sft"] = run_local(model, tokenizer, examples, "sft", cfg, batch_size, adapter="sft")
        runs["tuned"] = run_local(model, tokenizer, examples, "tuned", cfg, batch_size, adapter="default")
    runs = {s: runs[s] for s in SYSTEMS if s in runs}
    preference = preference_pass(cfg, model, tokenizer, rows, with_sft) if rows else None

    names = mx.metric_names(task)
    primary = mx.primary_metric(task)
    if examples:
        scores = {s: [mx.score(p, ex.reference, task) for p, ex in zip(run.predictions, examples, strict=True)]
                  for s, run in runs.items()}
        metrics = build_metrics({s: summarise(run, scores[s], names) for s, run in runs.items()}, len(examples))
        records = [{
            "index": ex.index,
            "input": ex.prompt if isinstance(ex.prompt, str) else
            next((m["content"] for m in reversed(ex.prompt) if m["role"] == "user"), ""),
            "reference": ex.reference,
            "predictions": {s: run.predictions[i] for s, run in runs.items()},
            "scores": {s: {k: round(v, 6) for k, v in scores[s][i].items()} for s in runs},
            "reference_loss": {s: round(run.nll[i] / max(1, run.n_tokens[i]), 6)
                               for s, run in runs.items() if run.n_tokens},
        } for i, ex in enumerate(examples)]
    else:  # no task pass (KTO rows without a reference): the preference metrics alone
        metrics, records = {"examples": 0}, []
    note = task_pass_note(rows, len(examples)) if rows else None
    if preference:  # the pairs' metrics next to the task's; each example's log-probabilities with it
        metrics["preference"] = preference[0]
        for rec, ex in zip(records, examples, strict=True):
            rec["logps"] = preference[1][ex.row if ex.row is not None else ex.index]
        if not examples:
            records = [{"index": r["index"], "logps": r} for r in preference[1]]

    out_dir = Path(cfg.paths.eval_dir)
    root = Path(cfg.paths.root)
    record = mf.stage_record("eval", cfg, out_dir / "manifest.json", **{
        "seeds": mf.seeds_record(cfg),
        "device": device,
        "dtype": dtype,
        "batch_size": batch_size,
        "inputs": {"holdout": {**mf.path_record(holdout, root), "examples": len(examples)},
                   "adapter": mf.path_record(Path(cfg.paths.adapter), root),
                   "base_model": mf.base_model_record(model_dir)},
        "baseline": {"url": cfg.eval.baseline.url, "model": cfg.eval.baseline.model} if "baseline" in runs else None,
        **({"task_pass": note} if note else {}),
        "timing": {"wall_seconds": round(time.time() - started, 2),
                   **{s: {"seconds": round(run.seconds, 2),
                          "examples_per_second": round(len(examples) / run.seconds, 3) if run.seconds else None,
                          "new_tokens_per_second": round(sum(run.new_tokens) / run.seconds, 1)
                          if run.seconds else None}
                      for s, run in runs.items()},
                   "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                   if device == "cuda" else None},
    })
    table = write_outputs(out_dir, root, cfg, metrics, records, names, primary, record, note)
    print(f"\n{table}\n\nreport: {out_dir / 'report.md'}   predictions: {out_dir / 'predictions.jsonl'}")
    log.info("eval done in %.1fs (%s)", record["timing"]["wall_seconds"],
             ", ".join(f"{s} {run.seconds:.1f}s" for s, run in runs.items()) or "preference metrics only")
    return {"metrics": metrics, "manifest": record}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        evaluate(cfg)


if __name__ == "__main__":
    main()
