"""Does a GGUF answer like the merged HF model? (used by reprotune.gguf)

Every holdout prompt must become the same token ids through the GGUF's own chat template and tokenizer as through
the HF tokenizer (a hard failure otherwise); then the greedy answers of the merged HF model (fp32) and of the GGUF
(llama.cpp) to the first export.parity.examples prompts are compared, and the task metric of the GGUF's answers is
scored against the holdout references (reprotune.gguf_quality's gate turns the numbers into a verdict).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from reprotune import gguf_quality as gq
from reprotune import llamacpp
from reprotune.errors import ReprotuneError
from reprotune.gguf_build import load_vocab
from reprotune.io import read_conversations
from reprotune.models import load_float32
from reprotune.preference.pair_eval import export_conversations, read_pairs
from reprotune.run import Run

Prompt = list[dict] | str  # a chat prompt (messages) or, from text (standard) preference pairs, a text prompt


# ---------------------------------------------------------------------------------------------- prompts
def holdout_prompts(run: Run) -> list[Prompt]:
    """The holdout prompts the parity checks answer, in file order: each conversation up to its last assistant
    answer (a preference holdout's rows as prompt + chosen answer, cut the same way). Text (standard) preference
    pairs give their text prompts: that model was trained on raw text, with no chat template, and is asked the
    same way (llama.cpp's completion, Ollama's raw prompt). run: the stage's (its objective, paths.prepared)."""
    path = run.path("prepared") / "holdout.jsonl"
    if not run.objective.preference:
        return prompts_of(read_conversations(path, "run 'make prepare' first"))
    conversations = export_conversations(path)
    if isinstance(conversations[0], str):
        return [row["prompt"] for row in read_pairs(path)]
    return prompts_of(conversations)


def prompts_of(conversations: list[list[dict]]) -> list[list[dict]]:
    """Each holdout conversation up to (not including) its last assistant answer."""
    out = []
    for conv in conversations:
        cut = max((i for i, m in enumerate(conv) if m["role"] == "assistant"), default=len(conv))
        out.append(conv[:cut])
    return out


def hf_prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The ids the model answers: a chat prompt rendered with the generation prompt; a text prompt tokenized as
    TRL tokenizes one (with the tokenizer's own special tokens, a BOS where it adds one)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def greedy_subset(cfg: DictConfig, n_prompts: int) -> int:
    """How many holdout prompts (the first ones, in file order) get the greedy comparison."""
    examples = cfg.export.parity.examples
    if examples == "all":
        return n_prompts
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ReprotuneError(f"export.parity.examples: must be a positive number or 'all', not {examples!r}")
    return min(int(examples), n_prompts)


# ------------------------------------------------------------------------------------------ tokenization
def check_template_and_tokens(vocab: Any, tokenizer: Any, prompts: list[Prompt], name: str) -> list[list[int]]:
    """The GGUF's own chat template and tokenizer must turn every prompt into the HF ids (hard failure).

    A chat prompt's template is rendered the way llama-cpp-python's server renders it (Jinja2ChatFormatter); a text
    prompt is tokenized the way its completion endpoint tokenizes one (the GGUF's own BOS/EOS flags, special
    tokens parsed)."""
    formatter = chat_formatter(vocab, tokenizer, name) if any(not isinstance(p, str) for p in prompts) else None
    ids = []
    for n, prompt in enumerate(prompts):
        hf_ids = hf_prompt_ids(tokenizer, prompt)
        if isinstance(prompt, str):
            cpp_ids = vocab.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        else:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            if formatter(messages=prompt).prompt != text:
                raise ReprotuneError(f"gguf: {name}: its chat template renders holdout prompt {n} differently from "
                                     "the HF tokenizer's chat template")
            cpp_ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if cpp_ids != hf_ids:
            at = next((i for i, (a, b) in enumerate(zip(cpp_ids, hf_ids, strict=False)) if a != b),
                      min(len(cpp_ids), len(hf_ids)))
            raise ReprotuneError(f"gguf: {name}: llama.cpp tokenizes holdout prompt {n} differently from the HF "
                                 f"tokenizer (first difference at token {at}: {cpp_ids[at:at + 3]} vs "
                                 f"{hf_ids[at:at + 3]})")
        ids.append(hf_ids)
    return ids


def chat_formatter(vocab: Any, tokenizer: Any, name: str) -> Any:
    """llama-cpp-python's renderer of the chat template inside the GGUF (its server's)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = vocab.metadata().get("tokenizer.chat_template")
    if not template:
        raise ReprotuneError(f"gguf: {name} carries no chat template (tokenizer.chat_template)")
    return Jinja2ChatFormatter(template=template, eos_token=tokenizer.eos_token or "",
                               bos_token=tokenizer.bos_token or "", add_generation_prompt=True)


# ---------------------------------------------------------------------------------------- greedy answers
def greedy_llama(llm: Any, prompt_ids: list[list[int]], max_new: int, eog: set[int], name: str) -> list[list[int]]:
    from tqdm import tqdm

    outputs = []
    for ids in tqdm(prompt_ids, desc=f"greedy {name}", unit="prompt", file=sys.stderr):
        out: list[int] = []
        # temp 0 is llama.cpp's greedy sampler; no repetition penalty, like HF's generate
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if tok in eog or len(out) >= max_new:
                break
            out.append(int(tok))
        outputs.append(out)
    return outputs


HF_BATCH = 8


def greedy_hf(merged_dir: Path, prompt_ids: list[list[int]], max_new: int, eog: list[int]) -> list[list[int]]:
    """Greedy answers of the merged model (float32), in left-padded batches of HF_BATCH prompts.

    Each answer ends at its first end-of-generation token; what follows it in a batch row is padding."""
    import torch
    from tqdm import tqdm

    model = load_float32(merged_dir)
    outputs: list[list[int]] = [[] for _ in prompt_ids]
    order = sorted(range(len(prompt_ids)), key=lambda i: (-len(prompt_ids[i]), i))  # similar lengths together
    batches = [order[i:i + HF_BATCH] for i in range(0, len(order), HF_BATCH)]
    with torch.inference_mode():
        for batch in tqdm(batches, desc="greedy HF (merged, fp32)", unit="batch", file=sys.stderr):
            answers = hf_batch(model, [prompt_ids[i] for i in batch], max_new, eog)
            for i, answer in zip(batch, answers, strict=True):
                outputs[i] = answer
    return outputs


def hf_batch(model: Any, prompts: list[list[int]], max_new: int, eog: list[int]) -> list[list[int]]:
    """One left-padded batch through generate; each answer cut at its first end-of-generation token."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eog[0], dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eog, pad_token_id=eog[0])
    answers = []
    for row in range(len(prompts)):
        new = [int(t) for t in gen[row, width:]]
        answers.append(new[: next((k for k, t in enumerate(new) if t in eog), len(new))])
    return answers


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two answers share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_greedy(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, Any]:
    exact = [r == c for r, c in zip(reference, candidate, strict=True)]
    matched = sum(common_prefix(r, c) for r, c in zip(reference, candidate, strict=True))
    total = sum(max(len(r), len(c)) for r, c in zip(reference, candidate, strict=True))
    return {"exact_match_rate": sum(exact) / len(exact), "exact_matches": sum(exact), "prompts": len(exact),
            "token_prefix_agreement": matched / total if total else 1.0,
            "mismatched_prompts": [i for i, e in enumerate(exact) if not e]}


# ------------------------------------------------------------------------------------------- task metric
def task_references(cfg: DictConfig, run: Run, n: int) -> tuple[dict | None, list[str]]:
    """data.task and the reference answers of the first n holdout conversations (their last assistant message),
    for the task metric of the gate; a preference holdout has none here (the gate is then parity alone)."""
    from omegaconf import OmegaConf

    if run.objective.preference or not cfg.data.get("task"):
        return None, []
    from reprotune import metrics as mx

    conversations = read_conversations(run.path("prepared") / "holdout.jsonl", "run 'make prepare' first")
    refs = [next(m["content"] for m in reversed(conv) if m["role"] == "assistant") for conv in conversations]
    # resolved as eval resolves it (the whole holdout's answers decide an auto type): the gate scores eval's metric
    task = mx.run_task(OmegaConf.to_container(cfg.data.task, resolve=True), refs, str(cfg.data.path),
                       run.paths["raw"])
    return task, refs[:n]


def type_mix(info: dict[str, Any]) -> dict[str, Any]:
    total = sum(info["type_bytes"].values())
    return {t: {"tensors": info["type_counts"][t], "bytes": info["type_bytes"][t],
                "share_of_bytes": round(info["type_bytes"][t] / total, 4)}
            for t in sorted(info["type_counts"], key=lambda t: -info["type_bytes"][t])}


# ---------------------------------------------------------------------------------------- one file's check
class FileCheck:
    """Everything 'make gguf' checks on one GGUF file: tokenization (hard), greedy parity, task metric, gate."""

    def __init__(self, parity: DictConfig, seed: int, src: Path, tokenizer: Any, prompts: list[Prompt],
                 greedy_prompts: list, hf_out: list[list[int]], eog: list[int], n_threads: int,
                 task_cfg: dict | None, references: list[str], primary: str | None) -> None:
        self.parity, self.seed, self.src, self.tokenizer, self.prompts = parity, seed, src, tokenizer, prompts
        self.n_greedy, self.hf_out, self.eog, self.n_threads = len(greedy_prompts), hf_out, eog, n_threads
        self.task_cfg, self.references, self.primary = task_cfg, references, primary

    def run(self, name: str, path: Path, report: dict[str, Any], timing: dict[str, float]) -> None:
        prompt_ids = self.tokenization(name, path, report)
        answers = self.greedy(name, path, prompt_ids, report, timing)
        task = None
        if self.task_cfg is not None:
            task = gq.task_scores(answers, self.references, self.task_cfg)
            report["task"][name] = task
        report["gate"][name] = gq.gate(report["greedy"][name], task, report["task"].get("hf_merged"),
                                       self.primary, self.parity)

    def tokenization(self, name: str, path: Path, report: dict[str, Any]) -> list[list[int]]:
        """The file's type mix and size, its pre-tokenizer, and the prompt ids through its template (hard)."""
        info = llamacpp.gguf_info(self.src, path)
        report["type_mix"][name] = type_mix(info)
        report["bytes"][name] = path.stat().st_size
        if info["metadata"]["tokenizer.ggml.pre"] in (None, "default"):
            raise ReprotuneError(f"gguf: {path.name} has no pre-tokenizer type; llama.cpp would guess")
        vocab = load_vocab(path)
        prompt_ids = check_template_and_tokens(vocab, self.tokenizer, self.prompts, path.name)
        vocab.close()
        report["tokenization"][name] = {"identical": True, "prompts": len(prompt_ids),
                                        "tokens": sum(map(len, prompt_ids))}
        return prompt_ids

    def greedy(self, name: str, path: Path, prompt_ids: list[list[int]], report: dict[str, Any],
               timing: dict[str, float]) -> list[str]:
        """The file's greedy answers (llama.cpp) against the HF model's; the answers as text."""
        from llama_cpp import Llama

        t0 = time.time()
        llm = Llama(model_path=str(path), n_ctx=int(self.parity.n_ctx), n_threads=self.n_threads,
                    n_threads_batch=self.n_threads, seed=self.seed, verbose=False)
        out = greedy_llama(llm, prompt_ids[: self.n_greedy], int(self.parity.max_new_tokens),
                           set(self.eog), name)
        seconds = time.time() - t0
        timing[f"greedy_{name}_seconds"] = round(seconds, 2)
        report["tokens_per_second"][name] = round(sum(map(len, out)) / seconds, 2) if seconds > 0 else None
        report["greedy"][name] = compare_greedy(self.hf_out, out)
        # decoded the way llama-cpp-python's server decodes a completion, so 'make serve' can be compared
        answers = [llm.detokenize(o).decode("utf-8", errors="ignore") for o in out]
        report["gguf_outputs"][name] = answers
        del llm
        return answers


def ladder_rows(report: dict[str, Any], tried: list[str], primary: str | None) -> list[dict[str, Any]]:
    """One row per quant tried: size, speed, parity, task metric, verdict (the table and the plot)."""
    rows = []
    for q in tried:
        g, task = report["greedy"][q], report["task"].get(q)
        rows.append({"quant": q, "bytes": report["bytes"][q], "mib": round(report["bytes"][q] / 2**20, 1),
                     "tokens_per_second": report["tokens_per_second"].get(q),
                     "exact_match_rate": g["exact_match_rate"], "token_agreement": g["token_prefix_agreement"],
                     "task_metric": task[primary] if task and primary else None,
                     "reference_task_metric": report["task"]["hf_merged"][primary] if task and primary else None,
                     "passed": report["gate"][q]["passed"]})
    return rows
