"""Where a quantized GGUF's greedy answers leave the merged HF model's, and which tensors' quantization moves them.

    python bench/gguf_divergence.py [hydra overrides]   # after 'make gguf' (or 'make merge': it converts itself)
    VARIANTS="Q4_K_M; Q4_K_M emb=f16; Q4_K_M ffn_down=q8_0" python bench/gguf_divergence.py ...   # only those rows
    DETAIL="Q4_K_M" python bench/gguf_divergence.py ...  # and each prompt's first diverging token for that variant
    HF_CACHE=/tmp/hf.pt python bench/gguf_divergence.py ...  # keep the merged model's answers and logits for reruns

A variant is `RECIPE [noimatrix] [emb=TYPE] [PATTERN=TYPE ...]`: the llama-quantize recipe (Q4_K_M, Q8_0, ...;
F16 = the unquantized file itself), made from outputs/gguf/model-F16.gguf with outputs/gguf/imatrix.gguf unless
`noimatrix` (as make gguf makes it with export.imatrix.enabled), `emb=TYPE` the token embedding's type (the tied
output head's too: export.token_embedding_type), each `PATTERN=TYPE` a --tensor-type override
(export.tensor_types). The default rows raise one tensor family at a time to Q8_0 on top of Q4_K_M.

For each variant, on the first export.parity.examples holdout prompts (answered as make gguf answers them):
  - greedy: exact answers, token agreement and the task metric against the merged HF model's (make gguf's gate);
  - first difference: the median answer position of each answer's first diverging token, the merged HF model's
    top-1 - top-2 logit gap there (small: a near tie any rounding flips), and how many of those gaps are < 1;
  - teacher-forced (the HF answer fed to llama.cpp, one pass): the share of answer positions where the GGUF's
    top-1 token is the HF model's, and the mean KL(HF || GGUF) of the next-token distributions. These move
    smoothly with the quantization error, unlike exact answers, which one near tie flips: they rank the tensors.
The quantized variants go to a scratch folder, deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

FAMILIES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
DEFAULT_VARIANTS = ["F16", "Q8_0", "Q4_K_M noimatrix", "Q4_K_M", "Q4_K_M emb=f16",
                    *(f"Q4_K_M {f}=q8_0" for f in FAMILIES),
                    r"Q4_K_M attn_(q|k|v|output)\.=q8_0", r"Q4_K_M ffn_(gate|up|down)\.=q8_0", "Q5_K_M", "Q6_K"]
LOW_GAP = 1.0  # logits: a first difference at an HF top-1 - top-2 gap below this is a near tie


def parse_variant(spec: str) -> dict[str, Any]:
    """'RECIPE [noimatrix] [emb=TYPE] [PATTERN=TYPE ...]' -> the quantize settings."""
    recipe, *rest = spec.split()
    out: dict[str, Any] = {"name": spec, "recipe": recipe, "imatrix": True, "emb": None, "types": {}}
    for item in rest:
        if item == "noimatrix":
            out["imatrix"] = False
        elif item.startswith("emb="):
            out["emb"] = item.removeprefix("emb=")
        else:
            pattern, _, type_name = item.rpartition("=")
            out["types"][pattern] = type_name
    return out


# ------------------------------------------------------------------------------------- the merged model
def hf_reference(merged: Path, ids: list[list[int]], max_new: int, eog: list[int], cache: Path | None) -> dict:
    """The merged HF model's greedy answers and its log-probabilities at each answer position (and the one after
    the last answer token, where it ends), fp32; from `cache` when it holds them for these prompts."""
    import torch

    if cache is not None and cache.is_file():
        saved = torch.load(cache)
        if saved["prompt_ids"] == ids and saved["max_new"] == max_new:
            return saved
    from reprotune.gguf_parity import greedy_hf
    from reprotune.models import load_float32

    answers = greedy_hf(merged, ids, max_new, eog)
    model = load_float32(merged)
    logprobs = []
    with torch.inference_mode():
        for prompt, answer in zip(ids, answers, strict=True):
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:]
            logprobs.append(torch.log_softmax(logits.float(), dim=-1))
    saved = {"prompt_ids": ids, "max_new": max_new, "answers": answers, "logprobs": logprobs}
    if cache is not None:
        torch.save(saved, cache)
    return saved


def top2_gap(row: Any) -> float:
    top = row.topk(2).values
    return float(top[0] - top[1])


# ------------------------------------------------------------------------------------------- a variant
def make_variant(v: dict[str, Any], work: Path, f16_name: str, src: Path, n: int) -> Path:
    from reprotune import gguf_build as gb
    from reprotune import gguf_quality as gq

    path = work / "variant.gguf"
    path.unlink(missing_ok=True)
    if v["recipe"] == "F16":
        shutil.copy(work / f16_name, path)
    elif v["imatrix"]:
        gq.quantize_with_tool(src, work, f16_name, path.name, v["recipe"], n, gq.IMATRIX_FILE, v["emb"], v["types"])
    else:
        gb.quantize(work / f16_name, path, v["recipe"], n, v["emb"], v["types"])
    return path


def teacher_forced(path: Path, ids: list[list[int]], ref: dict, n: int, seed: int) -> tuple[float, float]:
    """Feed prompt + HF answer to llama.cpp in one pass: (share of answer positions whose top-1 is the HF
    model's next token, the HF answer's eos included; mean KL(HF || GGUF) over those positions)."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    longest = max(len(p) + len(a) for p, a in zip(ids, ref["answers"], strict=True))
    llm = Llama(model_path=str(path), n_ctx=longest + 8, n_batch=longest + 8, n_threads=n, n_threads_batch=n,
                seed=seed, logits_all=True, verbose=False)
    agree = total = 0
    kl_sum = 0.0
    for prompt, answer, hf_lp in zip(ids, ref["answers"], ref["logprobs"], strict=True):
        llm.reset()
        llm.eval(prompt + answer)
        logits = torch.from_numpy(np.array(llm.scores[len(prompt) - 1: len(prompt) + len(answer)]))
        lp = torch.log_softmax(logits.float(), dim=-1)
        agree += int((lp.argmax(-1) == hf_lp.argmax(-1)).sum())
        kl_sum += float((hf_lp.exp() * (hf_lp - lp)).sum())
        total += len(answer) + 1
    del llm
    return agree / total, kl_sum / total


def first_differences(ref: dict, out: list[list[int]]) -> list[dict[str, Any]]:
    """Each answer's first diverging token: where, the HF token and the GGUF's, and the HF logit gaps there."""
    from reprotune.gguf_parity import common_prefix

    rows = []
    for i, (hf, o, lp) in enumerate(zip(ref["answers"], out, ref["logprobs"], strict=True)):
        k = common_prefix(hf, o)
        if hf == o or k >= len(hf) or k >= len(o):  # identical, or one answer stops where the other goes on
            if hf != o:
                rows.append({"prompt": i, "at": k, "hf": hf[k] if k < len(hf) else None,
                             "gguf": o[k] if k < len(o) else None, "gap": top2_gap(lp[k]), "margin": None})
            continue
        rows.append({"prompt": i, "at": k, "hf": hf[k], "gguf": o[k], "gap": top2_gap(lp[k]),
                     "margin": float(lp[k][hf[k]] - lp[k][o[k]])})
    return rows


def run_variant(v: dict[str, Any], ctx: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from llama_cpp import Llama

    from reprotune import gguf_quality as gq
    from reprotune.gguf_parity import compare_greedy, greedy_llama

    t0 = time.time()
    path = make_variant(v, ctx["work"], ctx["f16_name"], ctx["src"], ctx["n"])
    t1 = time.time()
    llm = Llama(model_path=str(path), n_ctx=ctx["n_ctx"], n_threads=ctx["n"], n_threads_batch=ctx["n"],
                seed=ctx["seed"], verbose=False)
    out = greedy_llama(llm, ctx["ids"], ctx["max_new"], set(ctx["eog"]), v["name"])
    greedy_s = time.time() - t1
    answers = [llm.detokenize(o).decode("utf-8", errors="ignore") for o in out]
    del llm
    tf_agree, kl = teacher_forced(path, ctx["ids"], ctx["ref"], ctx["n"], ctx["seed"])
    cmp = compare_greedy(ctx["ref"]["answers"], out)
    diffs = first_differences(ctx["ref"], out)
    task = gq.task_scores(answers, ctx["refs"], ctx["task_cfg"])[ctx["primary"]] if ctx["task_cfg"] else None
    row = {"variant": v["name"], "mib": path.stat().st_size / 2**20, "exact": cmp["exact_matches"],
           "prompts": cmp["prompts"], "agreement": cmp["token_prefix_agreement"], "task": task,
           "at": statistics.median(d["at"] for d in diffs) if diffs else None,
           "gap": statistics.median(d["gap"] for d in diffs) if diffs else None,
           "low": sum(d["gap"] < LOW_GAP for d in diffs), "tf_agree": tf_agree, "kl": kl,
           "quantize_s": t1 - t0, "greedy_s": greedy_s, "tok_s": sum(map(len, out)) / greedy_s}
    return row, diffs


# -------------------------------------------------------------------------------------------- printing
def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_header(ctx: dict[str, Any]) -> None:
    gaps = [top2_gap(r) for lp in ctx["ref"]["logprobs"] for r in lp]
    print(f"\n{len(ctx['ids'])} prompts, <= {ctx['max_new']} new tokens; merged HF top-1 - top-2 logit gap over its "
          f"{len(gaps)} answer positions: median {statistics.median(gaps):.2f}, {sum(g < LOW_GAP for g in gaps)} "
          f"below {LOW_GAP}, {sum(g < 0.25 for g in gaps)} below 0.25; {ctx['primary']} {fmt(ctx['hf_task'], '.3f')}")
    print(f"{'variant':<40} {'MiB':>6} {'exact':>6} {'tokens':>7} {ctx['primary'] or 'task':>14} "
          f"{'1st diff at':>11} {'HF gap there':>12} {f'gaps<{LOW_GAP:g}':>8} {'TF top-1':>9} {'TF KL':>8} "
          f"{'quant s':>7} {'greedy s':>8} {'tok/s':>6}")


def print_row(r: dict[str, Any]) -> None:
    print(f"{r['variant']:<40} {r['mib']:>6.1f} {r['exact']:>3}/{r['prompts']:<2} {r['agreement']:>7.1%} "
          f"{fmt(r['task'], '.3f'):>14} {fmt(r['at'], '.0f'):>11} {fmt(r['gap'], '.2f'):>12} {r['low']:>8} "
          f"{r['tf_agree']:>9.2%} {r['kl']:>8.4f} {r['quantize_s']:>7.1f} {r['greedy_s']:>8.1f} {r['tok_s']:>6.1f}",
          flush=True)


def token_text(tokenizer: Any, token: int | None) -> str:
    return "<end>" if token is None else repr(tokenizer.decode([token]))


def print_detail(name: str, diffs: list[dict[str, Any]], ctx: dict[str, Any]) -> None:
    tok = ctx["tokenizer"]
    print(f"\n{name}: first diverging token per answer (HF gap = the merged model's top-1 - top-2 logit there; "
          "margin = its logit of its own token - of the GGUF's)")
    for d in diffs:
        hf_answer = ctx["ref"]["answers"][d["prompt"]]
        before = tok.decode(hf_answer[max(0, d["at"] - 6): d["at"]])
        print(f"  prompt {d['prompt']:>2} token {d['at']:>3}: ...{before!r} HF {token_text(tok, d['hf'])} vs GGUF "
              f"{token_text(tok, d['gguf'])}  HF gap {d['gap']:.2f}, margin {fmt(d['margin'], '.2f')}")


# ------------------------------------------------------------------------------------------------ main
def context(overrides: list[str]) -> dict[str, Any]:
    from reprotune import gguf as g
    from reprotune import gguf_build as gb
    from reprotune import gguf_parity as gp
    from reprotune import gguf_quality as gq
    from reprotune import metrics as mx
    from reprotune.config import compose
    from reprotune.models import load_tokenizer
    from reprotune.run import resolve

    cfg = compose(overrides)
    run = resolve(cfg, "gguf")
    merged, out_dir = run.path("merged"), run.path("gguf")
    tokenizer = load_tokenizer(merged)
    prompts = gp.holdout_prompts(run)
    prompts = prompts[: gp.greedy_subset(cfg, len(prompts))]
    ids = [gp.hf_prompt_ids(tokenizer, p) for p in prompts]
    max_new = int(cfg.export.parity.max_new_tokens)
    src = g.llamacpp.source_dir(cfg.export.get("llama_cpp_dir"))
    f16, imatrix = base_files(cfg, src, tokenizer, out_dir, g.threads(cfg))
    eog = gb.check_loads_cleanly(f16, gb.accepted_control_tokens(cfg.model, tokenizer))["eog_ids"]
    cache = Path(os.environ["HF_CACHE"]) if os.environ.get("HF_CACHE") else None
    ref = hf_reference(merged, ids, max_new, eog, cache)
    task_cfg, refs = gp.task_references(cfg, run, len(prompts))
    primary = mx.primary_metric(task_cfg) if task_cfg else None
    hf_task = (gq.task_scores([tokenizer.decode(o) for o in ref["answers"]], refs, task_cfg)[primary]
               if task_cfg else None)
    return {"cfg": cfg, "imatrix": imatrix, "f16": f16, "f16_name": f16.name, "tokenizer": tokenizer, "ids": ids,
            "max_new": max_new, "eog": eog, "ref": ref, "task_cfg": task_cfg, "refs": refs, "primary": primary,
            "hf_task": hf_task, "src": src, "n": g.threads(cfg), "n_ctx": int(cfg.export.parity.n_ctx),
            "seed": int(cfg.seed)}


def base_files(cfg: Any, src: Path, tokenizer: Any, out_dir: Path, n: int) -> tuple[Path, Path]:
    """make gguf's model-F16.gguf and imatrix.gguf; before make gguf has run (make merge only), the bench makes
    them the way it would (convert_hf_to_gguf.py, llama-imatrix on the train split), in BASE_DIR or a fresh folder
    that is kept for reruns (its path is printed)."""
    from reprotune import gguf as g
    from reprotune import gguf_build as gb
    from reprotune import gguf_quality as gq
    from reprotune.run import resolve

    f16, imatrix = out_dir / "model-F16.gguf", out_dir / gq.IMATRIX_FILE
    if f16.is_file():
        return f16, imatrix
    base = Path(os.environ.get("BASE_DIR") or tempfile.mkdtemp(prefix="gguf-div-base-"))
    base.mkdir(parents=True, exist_ok=True)
    f16, imatrix = base / "model-F16.gguf", base / gq.IMATRIX_FILE
    t0 = time.time()
    if not f16.is_file():
        gb.convert(src, Path(cfg.paths.merged), f16, str(cfg.export.outtype), str(cfg.export.name))
    t1 = time.time()
    if not imatrix.is_file():
        g.make_imatrix(cfg, resolve(cfg, "gguf"), src, tokenizer, f16, base, n)
    print(f"base files in {base} (convert {t1 - t0:.0f} s, imatrix {time.time() - t1:.0f} s)", flush=True)
    return f16, imatrix


def main(overrides: list[str]) -> None:
    from reprotune import gguf_quality as gq

    ctx = context(overrides)
    specs = [s.strip() for s in os.environ.get("VARIANTS", "").split(";") if s.strip()] or DEFAULT_VARIANTS
    detail = {s.strip() for s in os.environ.get("DETAIL", "").split(";") if s.strip()}
    imatrix = ctx["imatrix"]
    print_header(ctx)
    ctx["work"] = work = Path(tempfile.mkdtemp(prefix="gguf-div-"))
    details = {}
    try:
        shutil.copy(ctx["f16"], work / ctx["f16_name"])
        if imatrix.is_file():
            shutil.copy(imatrix, work / gq.IMATRIX_FILE)
        for spec in specs:
            v = parse_variant(spec)
            if v["imatrix"] and v["recipe"] != "F16" and not imatrix.is_file():
                print(f"{spec:<40} skipped: no {imatrix}")
                continue
            row, diffs = run_variant(v, ctx)
            print_row(row)
            if spec in detail:
                details[spec] = diffs
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, diffs in details.items():
        print_detail(name, diffs, ctx)


if __name__ == "__main__":
    main(sys.argv[1:])
