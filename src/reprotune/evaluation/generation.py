"""The local systems' passes: the base model loaded once with the adapter on top (disabled for the base pass),
greedy generation batched with left padding, and each reference answer's loss."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from omegaconf import DictConfig

from reprotune import varlen_attention
from reprotune.config import quantization
from reprotune.errors import ReprotuneError
from reprotune.evaluation.holdout import Example
from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
from reprotune.run import Run
from reprotune.runtime import attention


def load_model_and_tokenizer(cfg: DictConfig, run: Run):
    """The base model once, with the adapter on top: disable_adapter() gives the base back for its pass. run: the
    eval stage's (its paths.adapter, device, dtype and repro mode)."""
    from peft import PeftModel

    device, dtype, adapter_dir = str(run.device), str(run.dtype), run.path("adapter")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ReprotuneError(f"{adapter_dir / 'adapter_config.json'}: file: not found; run 'make train' first")
    model_dir = resolve_model_dir(cfg.model, run.paths["model_cache"])
    # the adapter directory carries the exact tokenizer and chat template the adapter was trained with
    tokenizer = load_tokenizer(adapter_dir)
    attn = attention(cfg, str(run.repro), packing=False, device=device)
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
