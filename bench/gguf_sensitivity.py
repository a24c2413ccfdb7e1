"""Where a quantized GGUF's greedy answers leave the merged HF model's, and which tensors' quantization moves them.

    python bench/gguf_sensitivity.py [hydra overrides]     # after 'make gguf' (outputs/merged, outputs/gguf)
    VARIANTS="Q4_K_M,Q4_K_M emb=Q8_0" python bench/gguf_sensitivity.py ...   # only those rows

Quantizes outputs/gguf/model-F16.gguf into variants (the Q4_K_M recipe as llama.cpp makes it; with the tied token
embedding/output head kept at Q8_0; with the attention or the FFN projections at Q8_0; with the importance
matrix of outputs/gguf/imatrix.gguf), answers the first export.parity.examples holdout prompts
greedily with each (llama.cpp, as make gguf does), and prints one table: exact answers, token agreement, and at
each first diverging token the merged HF model's logit margin (its top-1 logit minus the logit of the token the
GGUF chose; small = a near tie that any rounding flips). The variants go to a scratch folder, deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

Q8 = "q8_0"
ATTN = {r"attn_(q|k|v|output)\.weight": Q8}
FFN = {r"ffn_(gate|up|down)\.weight": Q8}
ATTN_VO = {r"attn_(v|output)\.weight": Q8}   # the value path alone (attn_v is the recipe's own first bump)
# name: (recipe, token_embedding_type, tensor_types, with the imatrix)
VARIANTS = {
    "F16": ("F16", None, None, False),  # no quantization: llama.cpp's own arithmetic against HF's fp32
    "Q4_K_M": ("Q4_K_M", None, None, False),
    "Q4_K_M emb=Q8_0": ("Q4_K_M", Q8, None, False),
    "Q4_K_M attn=Q8_0": ("Q4_K_M", None, ATTN, False),
    "Q4_K_M ffn=Q8_0": ("Q4_K_M", None, FFN, False),
    "Q4_K_M imatrix": ("Q4_K_M", None, None, True),
    "Q4_K_M imatrix emb=Q8_0": ("Q4_K_M", Q8, None, True),
    "Q4_K_M imatrix attn=Q8_0": ("Q4_K_M", None, ATTN, True),
    "Q4_K_M imatrix attn_v,o=Q8_0": ("Q4_K_M", None, ATTN_VO, True),
    "Q4_K_M imatrix ffn=Q8_0": ("Q4_K_M", None, FFN, True),
    "Q5_K_M imatrix attn=Q8_0": ("Q5_K_M", None, ATTN, True),
    "Q5_K_M imatrix": ("Q5_K_M", None, None, True),
    "Q6_K imatrix": ("Q6_K", None, None, True),
    "Q8_0": ("Q8_0", None, None, False),
}


def hf_margins(merged: Path, prompt_ids: list[list[int]], answers: list[list[int]]) -> list[list[list[float]]]:
    """For each prompt, the merged HF model's (fp32) logits at each answer position (one forward of prompt +
    answer), kept as the full rows (we need the logit of whatever token a GGUF chose)."""
    import torch

    from reprotune.models import load_float32

    model = load_float32(merged)
    rows = []
    with torch.inference_mode():
        for ids, ans in zip(prompt_ids, answers, strict=True):
            x = torch.tensor([ids + ans])
            logits = model(input_ids=x).logits[0, len(ids) - 1: len(ids) + len(ans)]
            rows.append(logits.float())
    return rows


def divergence(ref: list[int], out: list[int]) -> int | None:
    k = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)
    if k is None and len(ref) != len(out):
        k = min(len(ref), len(out))
    return k


def main(overrides: list[str]) -> None:
    from llama_cpp import Llama

    from reprotune import gguf as g
    from reprotune import gguf_quality as gq
    from reprotune.config import compose
    from reprotune.models import load_tokenizer

    cfg = compose(overrides)
    merged, out_dir = Path(cfg.paths.merged), Path(cfg.paths.gguf)
    f16 = out_dir / "model-F16.gguf"
    imatrix = out_dir / gq.IMATRIX_FILE
    src = g.llamacpp.source_dir(cfg.export.get("llama_cpp_dir"))
    tokenizer = load_tokenizer(merged)
    prompts = g.holdout_prompts(cfg)[: g.greedy_subset(cfg, len(g.holdout_prompts(cfg)))]
    ids = [g.hf_prompt_ids(tokenizer, p) for p in prompts]
    max_new = int(cfg.export.parity.max_new_tokens)
    eog = g.check_loads_cleanly(f16, g.accepted_control_tokens(cfg.model, tokenizer))["eog_ids"]
    hf = g.greedy_hf(merged, ids, max_new, eog)
    logits = hf_margins(merged, ids, hf)
    task_cfg, refs = g.task_references(cfg, len(prompts))
    from reprotune import metrics as mx

    primary = mx.primary_metric(task_cfg) if task_cfg else None
    hf_task = gq.task_scores([tokenizer.decode(o) for o in hf], refs, task_cfg)[primary] if task_cfg else None
    n = g.threads(cfg)
    # the HF model's own top-1 vs top-2 margin at every answer token: how close its greedy path runs to a tie
    all_gaps = [float(r.topk(2).values[0] - r.topk(2).values[1]) for row in logits for r in row[:-1]]
    print(f"\n{len(prompts)} prompts, <= {max_new} new tokens; merged HF top-1 - top-2 logit gap over its "
          f"{len(all_gaps)} answer tokens: median {statistics.median(all_gaps):.2f}, "
          f"{sum(x < 0.5 for x in all_gaps)} below 0.5; {primary} {hf_task}")
    print(f"{'variant':<26} {'MiB':>6} {'exact':>6} {'tokens':>7} {primary or '':>15} "
          f"{'median margin at 1st diff':>26} {'1st diff pos (median)':>22}")
    work = Path(tempfile.mkdtemp(prefix="gguf-sens-"))
    try:
        shutil.copy(f16, work / f16.name)
        if imatrix.is_file():
            shutil.copy(imatrix, work / gq.IMATRIX_FILE)
        only = [v.strip() for v in os.environ.get("VARIANTS", "").split(",") if v.strip()]
        for name, (recipe, emb, types, with_imatrix) in VARIANTS.items():
            if (with_imatrix and not imatrix.is_file()) or (only and name not in only):
                continue
            path = work / "variant.gguf"
            path.unlink(missing_ok=True)
            t0 = time.time()
            if recipe == "F16":
                shutil.copy(work / f16.name, path)
            elif with_imatrix:
                gq.quantize_with_tool(src, work, f16.name, path.name, recipe, n, gq.IMATRIX_FILE, emb, types)
            else:
                g.quantize(work / f16.name, path, recipe, n, emb, types)
            llm = Llama(model_path=str(path), n_ctx=int(cfg.export.parity.n_ctx), n_threads=n, n_threads_batch=n,
                        seed=int(cfg.seed), verbose=False)
            out = g.greedy_llama(llm, ids, max_new, set(eog), name)
            answers = [llm.detokenize(o).decode("utf-8", errors="ignore") for o in out]
            del llm
            cmp = g.compare_greedy(hf, out)
            margins, positions = [], []
            for row, ref, o in zip(logits, hf, out, strict=True):
                k = divergence(ref, o)
                if k is None or k >= len(ref) or k >= len(o):
                    continue
                margins.append(float(row[k][ref[k]] - row[k][o[k]]))
                positions.append(k)
            task = gq.task_scores(answers, refs, task_cfg)[primary] if task_cfg else None
            print(f"{name:<26} {path.stat().st_size / 2**20:>6.1f} {cmp['exact_matches']:>3}/{cmp['prompts']:<2} "
                  f"{cmp['token_prefix_agreement']:>7.1%} {task if task is not None else float('nan'):>15.3f} "
                  f"{statistics.median(margins) if margins else float('nan'):>26.2f} "
                  f"{statistics.median(positions) if positions else float('nan'):>22.0f}"
                  f"   ({time.time() - t0:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
