"""GGUF stage: convert the merged model with the pinned llama.cpp, quantize it, and prove it answers like
the Hugging Face model.

    python -m reprotune.gguf [hydra overrides]      # == make gguf ARGS="export.quant=[Q4_K_M,Q8_0]"
    python -m reprotune.gguf objective=dpo          # == make gguf ARGS="objective=dpo" (DVC stage gguf_pref)

Reads  outputs/merged/ (make merge), data/prepared/holdout.jsonl and train.jsonl (its system prompt).
Writes outputs/gguf/model-F16.gguf (convert_hf_to_gguf.py, export.outtype), model-<QUANT>.gguf for every
       export.quant, Modelfile (Ollama), parity.json; outputs/export/gguf_manifest.json (timings).
With a preference objective (reprotune.preference.route_paths): outputs/pref/merged and data/pairs/{holdout,train}
.jsonl (the holdout rows' prompts; the train pairs' shared system prompt) in, outputs/pref/gguf and
outputs/pref/export/gguf_manifest.json out. Text (standard) pairs train on raw text: their prompts are checked and
answered as text (llama.cpp's completion tokenization; the Modelfile passes the prompt as it is).

The failures users of other tools meet only after shipping are checked here, and each one stops the stage:
  - an unknown pre-tokenizer (the converter refuses; we say which hash and what to do);
  - any warning with which llama.cpp itself says generation will degrade, when it loads the GGUF;
  - a chat template in the GGUF that renders a prompt differently from the HF tokenizer's template;
  - a rendered prompt that llama.cpp tokenizes into different ids than the HF tokenizer (special tokens
    split into text, different pre-tokenization);
  - an end-of-turn token of the HF generation config that llama.cpp does not treat as end of generation
    (answers that never stop).
Then greedy answers of the merged HF model and of every GGUF are compared on the holdout (reported).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune import gguf_quality as gq
from reprotune import llamacpp
from reprotune import modelfile as mfile
from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.io import fresh_dir, read_conversations, swap_dir
from reprotune.models import load_float32, load_tokenizer
from reprotune.preference import is_preference, route_paths
from reprotune.preference.pair_eval import export_conversations, read_pairs

log = logging.getLogger("reprotune.gguf")

OUTTYPE_NAME = {"f16": "F16", "bf16": "BF16", "f32": "F32"}


def quant_list(cfg: DictConfig) -> list[str]:
    """The quants to make, smallest first for export.quant=auto (export.ladder), else as listed."""
    quants = gq.ladder(cfg.export.quant, cfg.export.ladder)
    import llama_cpp

    for q in quants:
        if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{q}"):
            known = sorted(k.removeprefix("LLAMA_FTYPE_MOSTLY_") for k in dir(llama_cpp)
                           if k.startswith("LLAMA_FTYPE_MOSTLY_"))
            raise ReprotuneError(f"gguf: export.quant: unknown llama.cpp type {q!r} (known: {', '.join(known)})")
    return quants


def threads(cfg: DictConfig) -> int:
    return int(cfg.export.threads or os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------- convert
def convert(src: Path, merged: Path, out: Path, outtype: str, model_name: str) -> None:
    """convert_hf_to_gguf.py from the pinned tree (it puts its own gguf-py first on sys.path). model_name is the
    GGUF's general.name (export.name, reprotune-<data.name>): without it the converter names the model after the
    merged folder ('Merged'), the same for every user's data; the quants copy it."""
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(merged), "--outtype", outtype,
           "--outfile", str(out), "--model-name", model_name]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    log.info("converting %s -> %s (%s)", merged, out.name, outtype)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    captured = bytearray()
    assert proc.stdout is not None
    for chunk in iter(lambda: proc.stdout.read1(1 << 14), b""):  # forward as it comes: tqdm's progress bar
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        captured += chunk
    if proc.wait() == 0:
        return
    text = captured.decode("utf-8", errors="replace")
    if "pre-tokenizer was not recognized" in text:
        chk = llamacpp.CHKHSH_RE.search(text)
        raise ReprotuneError(
            f"gguf: llama.cpp {llamacpp.version()} does not know the pre-tokenizer of {merged}/tokenizer.json "
            f"(chkhsh {chk.group(1) if chk else '?'}); a GGUF with a guessed pre-tokenizer would tokenize "
            "differently from training. Use a llama.cpp that lists this tokenizer (lockfiles/llama-cpp.txt)")
    last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
    raise ReprotuneError(f"gguf: convert_hf_to_gguf.py failed on {merged}: {last[0]}")


def load_vocab(path: Path):
    """The GGUF's vocabulary and metadata only (llama.cpp's vocab_only load: no weights, no context)."""
    from llama_cpp import _internals, llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with llamacpp.captured_log():  # quiet: check_loads_cleanly reads the log where it matters
        return _internals.LlamaModel(path_model=str(path), params=params, verbose=True)


def accepted_control_tokens(model_cfg: Any, tokenizer: Any) -> frozenset[tuple[int, str]]:
    """model.llama_cpp_control_tokens: the (id, text) tokens whose control-looking warning a preset accepts, each
    checked against the HF tokenizer (the same id spells the same text there), so the exception names one token of
    one vocabulary and nothing else."""
    accepted = set()
    for item in model_cfg.get("llama_cpp_control_tokens") or []:
        token_id, text = int(item["id"]), str(item["text"])
        if tokenizer.convert_ids_to_tokens(token_id) != text:
            raise ReprotuneError(f"model '{model_cfg.name}': model.llama_cpp_control_tokens: id {token_id} is "
                                 f"{tokenizer.convert_ids_to_tokens(token_id)!r} in the tokenizer, not {text!r}")
        accepted.add((token_id, text))
    return frozenset(accepted)


def check_loads_cleanly(path: Path, accepted: frozenset[tuple[int, str]] = frozenset()) -> dict[str, Any]:
    """Load the GGUF's vocabulary with llama.cpp and fail on any warning that it degrades generation (but the
    control-looking-token warnings of the `accepted` (id, text) tokens)."""
    from llama_cpp import _internals, llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with llamacpp.captured_log() as lines:
        vocab = _internals.LlamaModel(path_model=str(path), params=params, verbose=True)
    bad = llamacpp.degrading_warnings(lines, accepted)
    if bad:
        raise ReprotuneError(f"gguf: llama.cpp warns about {path.name}: {bad[0]}")
    eog = eog_ids(vocab)
    vocab.close()
    return {"warnings": llamacpp.warnings_of(lines), "eog_ids": eog}


def eog_ids(vocab) -> list[int]:
    """Token ids llama.cpp ends generation on (the end-of-turn set of the GGUF)."""
    import llama_cpp

    return [i for i in range(vocab.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab.vocab, i)]


# --------------------------------------------------------------------------------------------- quantize
def ggml_type(name: str) -> int:
    import llama_cpp

    value = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", None)
    if value is None:
        raise ReprotuneError(f"gguf: export.token_embedding_type: unknown ggml type {name!r} (e.g. q8_0, f16)")
    return int(value)


def quantize(src_gguf: Path, out: Path, quant: str, n_threads: int, token_embedding_type: str | None = None,
             tensor_types: dict[str, str] | None = None) -> None:
    """llama_model_quantize, the function llama.cpp's llama-quantize tool calls, from the pinned libllama;
    token_embedding_type: that tensor's type (--token-embedding-type; a tied model's output head too);
    tensor_types: {regex of tensor names: type} (--tensor-type)."""
    import ctypes

    import llama_cpp
    from tqdm import tqdm

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = n_threads
    if token_embedding_type:
        params.token_embedding_type = ggml_type(token_embedding_type)
    if tensor_types:  # a C array ended by a null pattern, as llama-quantize builds it
        overrides = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for i, (pattern, type_name) in enumerate(tensor_types.items()):
            overrides[i].pattern = pattern.encode()
            overrides[i].type = ggml_type(type_name)
        overrides[len(tensor_types)].pattern = None
        params.tt_overrides = overrides
    bar = tqdm(desc=f"quantize {quant}", unit="tensor", file=sys.stderr)
    step = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")

    def progress(level: int, text: str) -> None:
        if match := step.search(text):
            bar.total = int(match.group(2))
            bar.update(int(match.group(1)) - bar.n)

    with llamacpp.captured_log(progress) as lines:
        rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(out).encode(), ctypes.byref(params))
    bar.close()
    if rc != 0:
        errors = llamacpp.warnings_of(lines) or ["(no message)"]
        raise ReprotuneError(f"gguf: quantizing {src_gguf.name} to {quant} failed: {errors[-1]}")


# ----------------------------------------------------------------------------------------------- parity
Prompt = list[dict] | str  # a chat prompt (messages) or, from text (standard) preference pairs, a text prompt


def holdout_prompts(cfg: DictConfig) -> list[Prompt]:
    """The holdout prompts the parity checks answer, in file order: each conversation up to its last assistant
    answer (a preference holdout's rows as prompt + chosen answer, cut the same way). Text (standard) preference
    pairs give their text prompts: that model was trained on raw text, with no chat template, and is asked the
    same way (llama.cpp's completion, Ollama's raw prompt)."""
    path = Path(cfg.paths.prepared) / "holdout.jsonl"
    if not is_preference(cfg):
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


def hf_prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The ids the model answers: a chat prompt rendered with the generation prompt; a text prompt tokenized as
    TRL tokenizes one (with the tokenizer's own special tokens, a BOS where it adds one)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def check_template_and_tokens(vocab, tokenizer, prompts: list[Prompt], name: str) -> list[list[int]]:
    """The GGUF's own chat template and tokenizer must turn every prompt into the HF ids (hard failure).

    A chat prompt's template is rendered the way llama-cpp-python's server renders it (Jinja2ChatFormatter); a text
    prompt is tokenized the way its completion endpoint tokenizes one (the GGUF's own BOS/EOS flags, special
    tokens parsed)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = None
    if any(not isinstance(p, str) for p in prompts):
        template = vocab.metadata().get("tokenizer.chat_template")
        if not template:
            raise ReprotuneError(f"gguf: {name} carries no chat template (tokenizer.chat_template)")
        formatter = Jinja2ChatFormatter(template=template, eos_token=tokenizer.eos_token or "",
                                        bos_token=tokenizer.bos_token or "", add_generation_prompt=True)
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
                              f"tokenizer (first difference at token {at}: {cpp_ids[at:at + 3]} vs {hf_ids[at:at + 3]})")
        ids.append(hf_ids)
    return ids


def greedy_llama(llm, prompt_ids: list[list[int]], max_new: int, eog: set[int], name: str) -> list[list[int]]:
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
            width = max(len(prompt_ids[i]) for i in batch)
            ids = torch.full((len(batch), width), eog[0], dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, width - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
                mask[row, width - len(prompt_ids[i]):] = 1
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eog, pad_token_id=eog[0])
            for row, i in enumerate(batch):
                new = [int(t) for t in gen[row, width:]]
                outputs[i] = new[: next((k for k, t in enumerate(new) if t in eog), len(new))]
    return outputs


def greedy_subset(cfg: DictConfig, n_prompts: int) -> int:
    """How many holdout prompts (the first ones, in file order) get the greedy comparison."""
    examples = cfg.export.parity.examples
    if examples == "all":
        return n_prompts
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ReprotuneError(f"export.parity.examples: must be a positive number or 'all', not {examples!r}")
    return min(int(examples), n_prompts)


def compare_greedy(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, Any]:
    exact = [r == c for r, c in zip(reference, candidate, strict=True)]

    def common_prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    matched = sum(common_prefix(r, c) for r, c in zip(reference, candidate, strict=True))
    total = sum(max(len(r), len(c)) for r, c in zip(reference, candidate, strict=True))
    return {"exact_match_rate": sum(exact) / len(exact), "exact_matches": sum(exact), "prompts": len(exact),
            "token_prefix_agreement": matched / total if total else 1.0,
            "mismatched_prompts": [i for i, e in enumerate(exact) if not e]}


def type_mix(info: dict[str, Any]) -> dict[str, Any]:
    total = sum(info["type_bytes"].values())
    return {t: {"tensors": info["type_counts"][t], "bytes": info["type_bytes"][t],
                "share_of_bytes": round(info["type_bytes"][t] / total, 4)}
            for t in sorted(info["type_counts"], key=lambda t: -info["type_bytes"][t])}


# ------------------------------------------------------------------------------------------------- main
def gguf(cfg: DictConfig) -> dict[str, Any]:
    from reprotune import kernels
    from reprotune import manifest as mf

    kernels.route_matmul_as_pinned()

    started = time.time()
    route_paths(cfg)  # a preference run: outputs/pref/merged and data/pairs in, outputs/pref/{gguf,export} out
    merged = Path(cfg.paths.merged)
    if not (merged / "config.json").is_file():
        how = f"make merge ARGS=\"objective={cfg.objective.name}\"" if is_preference(cfg) else "make merge"
        raise ReprotuneError(f"gguf: {merged}/config.json not found; run '{how}' first")
    src = llamacpp.source_dir(cfg.export.get("llama_cpp_dir"))
    quants = quant_list(cfg)
    tensor_types = gq.tensor_types(cfg.export.get("tensor_types"))
    auto = isinstance(cfg.export.quant, str) and cfg.export.quant == gq.AUTO
    n_threads = threads(cfg)
    outtype = str(cfg.export.outtype)
    if outtype not in OUTTYPE_NAME:
        raise ReprotuneError(f"gguf: export.outtype must be one of {', '.join(OUTTYPE_NAME)}, not {outtype!r}")
    tokenizer = load_tokenizer(merged)
    prompts = holdout_prompts(cfg)
    text_prompts = isinstance(prompts[0], str)

    final = Path(cfg.paths.gguf)
    tmp = fresh_dir(final)
    timing: dict[str, float] = {}

    # 1. convert, then let llama.cpp load it and say whether anything degrades generation
    base_name = f"model-{OUTTYPE_NAME[outtype]}.gguf"
    t0 = time.time()
    convert(src, merged, tmp / base_name, outtype, str(cfg.export.name))
    timing["convert_seconds"] = round(time.time() - t0, 2)
    accepted = accepted_control_tokens(cfg.model, tokenizer)
    load = check_loads_cleanly(tmp / base_name, accepted)
    eog = load["eog_ids"]
    gen_eos = json.loads((merged / "generation_config.json").read_text()).get("eos_token_id")
    missing = [e for e in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or []) if e not in eog]
    if missing:
        raise ReprotuneError(f"gguf: {base_name}: llama.cpp does not stop on eos id(s) {missing} of "
                          f"{merged}/generation_config.json; answers would never end")

    # 2. the importance matrix of the training data (export.imatrix), then the HF reference answers
    imatrix = None
    if cfg.export.imatrix.enabled:
        t0 = time.time()
        imatrix = make_imatrix(cfg, src, tokenizer, tmp / base_name, tmp, n_threads)
        timing["imatrix_seconds"] = round(time.time() - t0, 2)
    greedy_prompts = prompts[: greedy_subset(cfg, len(prompts))]
    max_new = int(cfg.export.parity.max_new_tokens)
    t0 = time.time()
    hf_out = greedy_hf(merged, [hf_prompt_ids(tokenizer, p) for p in greedy_prompts], max_new, eog)
    timing["hf_greedy_seconds"] = round(time.time() - t0, 2)
    hf_text = [tokenizer.decode(o) for o in hf_out]
    task_cfg, references = task_references(cfg, len(greedy_prompts))
    primary = None
    report: dict[str, Any] = {
        "llama_cpp_python": llamacpp.version(), "holdout_prompts": len(prompts),
        "prompt_format": "text" if text_prompts else "chat",
        "greedy_prompts": len(greedy_prompts), "max_new_tokens": max_new, "eog_ids": eog,
        "greedy_selection": f"the first {len(greedy_prompts)} holdout prompts in file order "
                            "(export.parity.examples=N, or all)",
        "quant_request": cfg.export.quant if isinstance(cfg.export.quant, str) else list(cfg.export.quant),
        "imatrix": imatrix, "token_embedding_type": cfg.export.token_embedding_type,
        "tensor_types": tensor_types,
        "tokenization": {}, "greedy": {}, "gate": {}, "task": {}, "tokens_per_second": {}, "bytes": {},
        "hf_outputs": hf_text, "gguf_outputs": {}, "type_mix": {},
    }
    if task_cfg is not None:
        from reprotune import metrics as mx

        primary = mx.primary_metric(task_cfg)
        report["task"] = {"metric": primary, "hf_merged": gq.task_scores(hf_text, references, task_cfg)}
    check = FileCheck(cfg.export.parity, int(cfg.seed), src, tokenizer, prompts, greedy_prompts, hf_out, eog,
                      n_threads, task_cfg, references, primary)

    # 3. F16 (reported, gated like the quants), then each quant; export.quant=auto stops at the first that passes
    files = {OUTTYPE_NAME[outtype]: base_name}
    check.run(OUTTYPE_NAME[outtype], tmp / base_name, report, timing)
    tried: list[str] = []
    for quant in quants:
        if quant == OUTTYPE_NAME[outtype]:
            continue
        filename = f"model-{quant}.gguf"
        t0 = time.time()
        if imatrix is not None:
            gq.quantize_with_tool(src, tmp, base_name, filename, quant, n_threads, gq.IMATRIX_FILE,
                                  cfg.export.token_embedding_type, tensor_types)
        else:
            quantize(tmp / base_name, tmp / filename, quant, n_threads, cfg.export.token_embedding_type,
                     tensor_types)
        timing[f"quantize_{quant}_seconds"] = round(time.time() - t0, 2)
        check_loads_cleanly(tmp / filename, accepted)
        files[quant] = filename
        tried.append(quant)
        check.run(quant, tmp / filename, report, timing)
        if auto and report["gate"][quant]["passed"]:
            break
    chosen = gq.choose({q: {"gate": report["gate"][q]} for q in tried}, tried)
    base = OUTTYPE_NAME[outtype]
    if auto:  # only the chosen quant ships (the others are in the table); none passing: the F16 file if it passed
        chosen = gq.auto_fallback(chosen, base, report["gate"])
        keep = chosen or (tried[-1] if tried else None)
        for q in tried:
            if q != keep:
                (tmp / files.pop(q)).unlink()
    report["ladder"] = ladder_rows(report, tried + ([base] if chosen == base else []), primary)
    serve_quant = serve_choice(cfg, auto, chosen, tried, files)
    report["serve_quant"] = serve_quant
    report["chosen_quant"] = chosen

    # 4. Ollama Modelfile for the served quant (the one 'make serve' serves too)
    serve_name = files[serve_quant]
    gen_eos_ids = [e for e in eog if e in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])]
    if text_prompts:  # trained on raw text: the prompt as it is, no chat turns, no system prompt
        template, system = mfile.RAW_TEMPLATE, None
        stops = mfile.eos_stop_tokens(tokenizer, gen_eos_ids)
    else:
        pieces = mfile.probe(tokenizer)
        template = mfile.go_template(pieces)
        system = (mfile.training_system_prompt(Path(cfg.paths.prepared) / "train.jsonl")
                  if cfg.export.ollama.system_from_data else None)
        stops = mfile.stop_tokens(tokenizer, pieces, gen_eos_ids)
    (tmp / "Modelfile").write_text(mfile.render_modelfile(serve_name, template, stops, system))
    report["modelfile"] = {"from": serve_name, "stop": stops, "system": system}
    # timings (tokens/s) differ run to run: they go to the metrics and the manifest, never into parity.json
    mf.write_json(tmp / "parity.json", {**{k: v for k, v in report.items() if k != "tokens_per_second"},
                                        "ladder": [{k: v for k, v in r.items() if k != "tokens_per_second"}
                                                   for r in report["ladder"]]})
    swap_dir(tmp, final)

    export_dir = Path(cfg.paths.export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    # numbers only (dvc metrics show/diff): one entry per quant tried; the table with its words is parity.json's ladder
    # (tokens/s is a timing: the manifest's, so that identical runs give identical metrics bytes)
    metrics = {r["quant"]: {**{k: v for k, v in r.items() if k not in ("quant", "passed", "tokens_per_second")},
                            "passed": int(r["passed"]), "served": int(r["quant"] == serve_quant)}
               for r in report["ladder"]}
    mf.write_json(export_dir / "gguf_metrics.json", metrics)
    gq.plot_ladder(report["ladder"], export_dir / "quant_ladder.png", primary)

    root = Path(cfg.paths.root)
    manifest_path = export_dir / "gguf_manifest.json"
    record = mf.stage_record("gguf", cfg, manifest_path, **{
        "seeds": {"seed": int(cfg.seed)},
        "llama_cpp": {"llama_cpp_python": llamacpp.version(), "source": str(src),
                      "system_info": llamacpp.system_info(),
                      "lock_sha256": mf.sha256_file(llamacpp.REPO / "lockfiles/llama-cpp.txt"),
                      **({"tools_sha256": {t: mf.sha256_file(gq.tool(src, t))
                                           for t in ("llama-imatrix", "llama-quantize")}} if imatrix else {})},
        "inputs": {"merged": mf.path_record(merged, root),
                   "holdout": mf.path_record(Path(cfg.paths.prepared) / "holdout.jsonl", root),
                   "train_data": mf.path_record(Path(cfg.paths.prepared) / "train.jsonl", root),
                   **({"imatrix_data": imatrix["data"]} if imatrix else {})},
        "outputs": {**{name: {**mf.path_record(final / f, root), "bytes": (final / f).stat().st_size}
                       for name, f in files.items()},
                    **({"imatrix": mf.path_record(final / gq.IMATRIX_FILE, root)} if imatrix else {}),
                    "parity": mf.path_record(final / "parity.json", root),
                    "modelfile": mf.path_record(final / "Modelfile", root)},
        "quality": {"served": serve_quant, "chosen": chosen, "tokens_per_second": report["tokens_per_second"]},
        "load_warnings": load["warnings"],
        "timing": {**timing, "wall_seconds": round(time.time() - started, 2)},
    })
    mf.write_json(manifest_path, record)
    print_summary(report, files, timing)
    return record


def make_imatrix(cfg: DictConfig, src: Path, tokenizer: Any, f16: Path, out_dir: Path, n_threads: int
                 ) -> dict[str, Any]:
    """llama-imatrix on the training split (prompts and answers, export.imatrix.max_tokens of them) into
    out_dir/imatrix.gguf; what it read is hashed (the text itself stays out of the outputs)."""
    import hashlib
    import shutil

    max_tokens, chunk = gq.imatrix_settings(cfg.export.imatrix)
    train_path = Path(cfg.paths.prepared) / "train.jsonl"
    conversations = (export_conversations(train_path) if is_preference(cfg)
                     else read_conversations(train_path, "run 'make prepare' first"))
    text, tokens, used = gq.calibration_text(conversations, tokenizer, max_tokens)
    if tokens < 2 * chunk:  # llama-imatrix needs two chunks: a small train split gets smaller chunks
        chunk = tokens // 2 - 8  # less the BOS and the odd token the tool's tokenization may add
        if chunk < 16:
            raise ReprotuneError(f"gguf: {train_path} has {tokens} tokens, too few for an importance matrix; "
                                 "set export.imatrix.enabled=false")
    work = out_dir.parent / f".{out_dir.name}.imatrix-work"
    try:
        info = gq.compute_imatrix(src, f16, text, work, out_dir / gq.IMATRIX_FILE, chunk, n_threads,
                                  bool(cfg.export.imatrix.process_output))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**info, "tokens": tokens, "conversations": used, "max_tokens": max_tokens,
            # relative to paths.root: parity.json must be the same bytes wherever the run is (make verify)
            "data": {"source": os.path.relpath(train_path, cfg.paths.root),
                     "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}}


def task_references(cfg: DictConfig, n: int) -> tuple[dict | None, list[str]]:
    """data.task and the reference answers of the first n holdout conversations (their last assistant message),
    for the task metric of the gate; a preference holdout has none here (the gate is then parity alone)."""
    from omegaconf import OmegaConf

    if is_preference(cfg) or not cfg.data.get("task"):
        return None, []
    from reprotune import metrics as mx

    conversations = read_conversations(Path(cfg.paths.prepared) / "holdout.jsonl", "run 'make prepare' first")
    refs = [next(m["content"] for m in reversed(conv) if m["role"] == "assistant") for conv in conversations]
    # resolved as eval resolves it (the whole holdout's answers decide an auto type): the gate scores eval's metric
    task = mx.run_task(OmegaConf.to_container(cfg.data.task, resolve=True), refs, str(cfg.data.path),
                       str(cfg.paths.raw))
    return task, refs[:n]


class FileCheck:
    """Everything 'make gguf' checks on one GGUF file: tokenization (hard), greedy parity, task metric, gate."""

    def __init__(self, parity: DictConfig, seed: int, src: Path, tokenizer: Any, prompts: list[Prompt],
                 greedy_prompts: list, hf_out: list[list[int]], eog: list[int], n_threads: int,
                 task_cfg: dict | None, references: list[str], primary: str | None) -> None:
        self.parity, self.seed, self.src, self.tokenizer, self.prompts = parity, seed, src, tokenizer, prompts
        self.n_greedy, self.hf_out, self.eog, self.n_threads = len(greedy_prompts), hf_out, eog, n_threads
        self.task_cfg, self.references, self.primary = task_cfg, references, primary

    def run(self, name: str, path: Path, report: dict[str, Any], timing: dict[str, float]) -> None:
        from llama_cpp import Llama

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
        task = None
        if self.task_cfg is not None:
            task = gq.task_scores(answers, self.references, self.task_cfg)
            report["task"][name] = task
        report["gate"][name] = gq.gate(report["greedy"][name], task, report["task"].get("hf_merged"),
                                       self.primary, self.parity)


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


def serve_choice(cfg: DictConfig, auto: bool, chosen: str | None, tried: list[str], files: dict[str, str]) -> str:
    """The quant the Modelfile and 'make serve' use: export.serve.quant when set; else the ladder's choice
    (export.quant=auto; the largest tried when none passed) or the first quant listed."""
    wanted = cfg.export.serve.quant
    if wanted:
        if str(wanted) not in files:
            raise ReprotuneError(f"gguf: export.serve.quant={wanted} is not among the files made "
                                 f"({', '.join(files)})")
        return str(wanted)
    if auto:
        return chosen or tried[-1]
    return tried[0] if tried else next(iter(files))


def print_summary(report: dict[str, Any], files: dict[str, str], timing: dict[str, float]) -> None:
    print(f"\nGGUF parity ({report['holdout_prompts']} holdout prompts; greedy on {report['greedy_prompts']}, "
          f"max {report['max_new_tokens']} new tokens)")
    print(f"  {'file':<20} {'prompt ids':>10} {'greedy exact':>13} {'token agree':>12}  type mix (share of bytes)")
    for name, filename in files.items():
        g, mix = report["greedy"][name], report["type_mix"][name]
        mix_s = ", ".join(f"{t} {v['share_of_bytes']:.0%}" for t, v in mix.items())
        print(f"  {filename:<20} {'identical':>10} {g['exact_match_rate']:>12.0%} "
              f"{g['token_prefix_agreement']:>11.1%}  {mix_s}")
    print("  timings: " + ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}s" for k, v in timing.items()))
    for row in report["ladder"]:  # one line per quant tried, the verdict of the gate (parity.json: gate)
        print(gq.summary_line(row["quant"], f"model-{row['quant']}.gguf", row["bytes"], report["greedy"][row["quant"]],
                              report["gate"][row["quant"]], report["task"].get(row["quant"]), row["tokens_per_second"]))
    served = report["serve_quant"]
    verdict = "passed" if report["gate"][served]["passed"] else "FAILED (make serve refuses it)"
    print(f"gguf: serving and Modelfile: model-{served}.gguf, which {verdict} the parity gate")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        gguf(cfg)


if __name__ == "__main__":
    main()
