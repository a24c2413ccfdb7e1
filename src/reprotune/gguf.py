"""GGUF stage: convert the merged model with the pinned llama.cpp, quantize it, and prove it answers like
the Hugging Face model.

    python -m reprotune.gguf [hydra overrides]      # == make gguf ARGS="export.quant=[Q4_K_M,Q8_0]"
    python -m reprotune.gguf objective=dpo          # == make gguf ARGS="objective=dpo" (DVC stage gguf_pref)

Reads  outputs/merged/ (make merge), data/prepared/holdout.jsonl and train.jsonl (its system prompt).
Writes outputs/gguf/model-F16.gguf (convert_hf_to_gguf.py, export.outtype), model-<QUANT>.gguf for every
       export.quant, Modelfile (Ollama), parity.json; outputs/export/gguf_manifest.json (timings).
With a preference objective (its paths from conf/objective/paths/preference.yaml): outputs/pref/merged and data/pairs/{holdout,train}
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
Then greedy answers of the merged HF model and of every GGUF are compared on the holdout and gated
(reprotune.gguf_build makes and loads the files, reprotune.gguf_parity compares them, reprotune.gguf_quality
holds the gate and the ladder).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune import gguf_build as gb
from reprotune import gguf_parity as gp
from reprotune import gguf_quality as gq
from reprotune import llamacpp
from reprotune import modelfile as mfile
from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.io import fresh_dir, read_conversations, swap_dir
from reprotune.models import load_tokenizer
from reprotune.preference.pair_eval import export_conversations
from reprotune.run import Run, resolve

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


@contextmanager
def timed(timing: dict[str, float], key: str) -> Iterator[None]:
    t0 = time.time()
    yield
    timing[key] = round(time.time() - t0, 2)


@dataclass
class Export:
    """What the steps of one make gguf share: the settings read once, the scratch folder, the timings."""

    cfg: DictConfig
    resolved: Run                  # the stage's (reprotune.run.Run): its objective and paths
    src: Path
    merged: Path
    quants: list[str]
    tensor_types: dict[str, str]
    auto: bool
    n_threads: int
    base: str                      # the unquantized file's name in the tables: F16 (export.outtype)
    tokenizer: Any
    prompts: list[gp.Prompt]
    final: Path
    tmp: Path
    timing: dict[str, float] = field(default_factory=dict)
    accepted: frozenset[tuple[int, str]] = frozenset()
    eog: list[int] = field(default_factory=list)
    gen_eos: list[int] = field(default_factory=list)
    load_warnings: list[str] = field(default_factory=list)

    @property
    def base_name(self) -> str:
        return f"model-{self.base}.gguf"

    @property
    def text_prompts(self) -> bool:
        return isinstance(self.prompts[0], str)


# ------------------------------------------------------------------------------------------------- main
def gguf(cfg: DictConfig, resolved: Run | None = None) -> dict[str, Any]:
    """resolved: the stage's Run (main resolves it first; a caller without one: resolve(cfg, "gguf"))."""
    from reprotune import kernels

    kernels.route_matmul_as_pinned()
    started = time.time()
    run = start(cfg, resolved if resolved is not None else resolve(cfg, "gguf"))
    make_base_file(run)                                  # 1. convert; llama.cpp loads it cleanly and stops
    imatrix = imatrix_step(run)                          # 2. the importance matrix of the training data
    report, check = reference_answers(run, imatrix)      # 2. the merged HF model's greedy answers
    files, tried = check_all_files(run, report, check)   # 3. F16, then each quant (auto: up to the first pass)
    serve_quant = pick_served(run, report, files, tried)
    write_modelfile(run, report, files[serve_quant])     # 4. Ollama's Modelfile for the served file
    write_parity(run.tmp / "parity.json", report)
    swap_dir(run.tmp, run.final)
    write_metrics(run.resolved.path("export_dir"), report, serve_quant)
    record = write_manifest(run, report, files, imatrix, started)
    print_summary(report, files, run.timing)
    return record


def start(cfg: DictConfig, resolved: Run) -> Export:
    """The settings, checked (each bad one is one line), the tokenizer and prompts, a fresh scratch folder."""
    obj, merged = resolved.objective, resolved.path("merged")  # a preference run's: outputs/pref/merged (conf/objective/paths/preference.yaml)
    if not (merged / "config.json").is_file():
        how = f"make merge{obj.make_args}"
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
    prompts = gp.holdout_prompts(resolved)
    final = resolved.path("gguf")
    return Export(cfg=cfg, resolved=resolved, src=src, merged=merged, quants=quants, tensor_types=tensor_types, auto=auto,
               n_threads=n_threads, base=OUTTYPE_NAME[outtype], tokenizer=tokenizer, prompts=prompts,
               final=final, tmp=fresh_dir(final))


def make_base_file(run: Export) -> None:
    """convert_hf_to_gguf.py, then let llama.cpp load the file and say whether anything degrades generation."""
    cfg = run.cfg  # read as cfg.<key>: reprotune.pipeline finds the stage's params by that name
    with timed(run.timing, "convert_seconds"):
        gb.convert(run.src, run.merged, run.tmp / run.base_name, str(cfg.export.outtype), str(cfg.export.name))
    run.accepted = gb.accepted_control_tokens(cfg.model, run.tokenizer)
    load = gb.check_loads_cleanly(run.tmp / run.base_name, run.accepted)
    run.eog, run.load_warnings = load["eog_ids"], load["warnings"]
    run.gen_eos = gb.generation_eos(run.merged)
    gb.check_stops(run.eog, run.gen_eos, run.base_name, run.merged)


def imatrix_step(run: Export) -> dict[str, Any] | None:
    cfg = run.cfg
    if not cfg.export.imatrix.enabled:
        return None
    with timed(run.timing, "imatrix_seconds"):
        return make_imatrix(cfg, run.resolved, run.src, run.tokenizer, run.tmp / run.base_name, run.tmp,
                            run.n_threads)


def reference_answers(run: Export, imatrix: dict[str, Any] | None) -> tuple[dict[str, Any], gp.FileCheck]:
    """The merged HF model's greedy answers, the report they start, and the check every GGUF then gets."""
    cfg = run.cfg
    greedy_prompts = run.prompts[: gp.greedy_subset(cfg, len(run.prompts))]
    max_new = int(cfg.export.parity.max_new_tokens)
    with timed(run.timing, "hf_greedy_seconds"):
        prompt_ids = [gp.hf_prompt_ids(run.tokenizer, p) for p in greedy_prompts]
        hf_out = gp.greedy_hf(run.merged, prompt_ids, max_new, run.eog)
    hf_text = [run.tokenizer.decode(o) for o in hf_out]
    task_cfg, references = gp.task_references(cfg, run.resolved, len(greedy_prompts))
    report = new_report(run, imatrix, len(greedy_prompts), max_new, hf_text)
    primary = None
    if task_cfg is not None:
        from reprotune import metrics as mx

        primary = mx.primary_metric(task_cfg)
        report["task"] = {"metric": primary, "hf_merged": gq.task_scores(hf_text, references, task_cfg)}
    check = gp.FileCheck(cfg.export.parity, int(cfg.seed), run.src, run.tokenizer, run.prompts, greedy_prompts,
                         hf_out, run.eog, run.n_threads, task_cfg, references, primary)
    return report, check


def new_report(run: Export, imatrix: dict[str, Any] | None, n_greedy: int, max_new: int, hf_text: list[str]
               ) -> dict[str, Any]:
    """parity.json's settings part, and the tables every file check fills (its keys in this order: same bytes)."""
    cfg = run.cfg
    quant = cfg.export.quant
    return {
        "llama_cpp_python": llamacpp.version(), "holdout_prompts": len(run.prompts),
        "prompt_format": "text" if run.text_prompts else "chat",
        "greedy_prompts": n_greedy, "max_new_tokens": max_new, "eog_ids": run.eog,
        "greedy_selection": f"the first {n_greedy} holdout prompts in file order "
                            "(export.parity.examples=N, or all)",
        "quant_request": quant if isinstance(quant, str) else list(quant),
        "imatrix": imatrix, "token_embedding_type": cfg.export.token_embedding_type,
        "tensor_types": run.tensor_types,
        "tokenization": {}, "greedy": {}, "gate": {}, "task": {}, "tokens_per_second": {}, "bytes": {},
        "hf_outputs": hf_text, "gguf_outputs": {}, "type_mix": {},
    }


# ------------------------------------------------------------------------------------------ quantize + check
def check_all_files(run: Export, report: dict[str, Any], check: gp.FileCheck) -> tuple[dict[str, str], list[str]]:
    """F16 (reported, gated like the quants), then each quant; export.quant=auto stops at the first that passes.
    Returns {name: file} of what was made and the quants tried, in order."""
    files = {run.base: run.base_name}
    check.run(run.base, run.tmp / run.base_name, report, run.timing)
    tried: list[str] = []
    for quant in run.quants:
        if quant == run.base:
            continue
        files[quant] = make_quant(run, quant)
        tried.append(quant)
        check.run(quant, run.tmp / files[quant], report, run.timing)
        if run.auto and report["gate"][quant]["passed"]:
            break
    return files, tried


def make_quant(run: Export, quant: str) -> str:
    """model-<quant>.gguf from the base file: llama-quantize with the imatrix, else libllama's own quantize."""
    filename = f"model-{quant}.gguf"
    cfg = run.cfg
    emb = cfg.export.token_embedding_type
    with timed(run.timing, f"quantize_{quant}_seconds"):
        if cfg.export.imatrix.enabled:
            gq.quantize_with_tool(run.src, run.tmp, run.base_name, filename, quant, run.n_threads, gq.IMATRIX_FILE,
                                  emb, run.tensor_types)
        else:
            gb.quantize(run.tmp / run.base_name, run.tmp / filename, quant, run.n_threads, emb, run.tensor_types)
    gb.check_loads_cleanly(run.tmp / filename, run.accepted)
    return filename


def pick_served(run: Export, report: dict[str, Any], files: dict[str, str], tried: list[str]) -> str:
    """The gate's choice and the served file; with export.quant=auto only the chosen quant ships (the others are in
    the table), and with none passing the F16 file does if it passed. Fills the report's ladder and choice."""
    chosen = gq.choose({q: {"gate": report["gate"][q]} for q in tried}, tried)
    if run.auto:
        chosen = gq.auto_fallback(chosen, run.base, report["gate"])
        keep = chosen or (tried[-1] if tried else None)
        for q in tried:
            if q != keep:
                (run.tmp / files.pop(q)).unlink()
    primary = report["task"].get("metric")
    report["ladder"] = gp.ladder_rows(report, tried + ([run.base] if chosen == run.base else []), primary)
    cfg = run.cfg
    serve_quant = serve_choice(cfg, run.auto, chosen, tried, files)
    report["serve_quant"] = serve_quant
    report["chosen_quant"] = chosen
    return serve_quant


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


# ------------------------------------------------------------------------------------------------ outputs
def write_modelfile(run: Export, report: dict[str, Any], serve_name: str) -> None:
    """Ollama's Modelfile for the served file (the one 'make serve' serves too)."""
    cfg = run.cfg
    gen_eos_ids = [e for e in run.eog if e in run.gen_eos]
    if run.text_prompts:  # trained on raw text: the prompt as it is, no chat turns, no system prompt
        template, system = mfile.RAW_TEMPLATE, None
        stops = mfile.eos_stop_tokens(run.tokenizer, gen_eos_ids)
    else:
        pieces = mfile.probe(run.tokenizer)
        template = mfile.go_template(pieces)
        system = (mfile.training_system_prompt(run.resolved.path("prepared") / "train.jsonl")
                  if cfg.export.ollama.system_from_data else None)
        stops = mfile.stop_tokens(run.tokenizer, pieces, gen_eos_ids)
    (run.tmp / "Modelfile").write_text(mfile.render_modelfile(serve_name, template, stops, system))
    report["modelfile"] = {"from": serve_name, "stop": stops, "system": system}


def write_parity(path: Path, report: dict[str, Any]) -> None:
    """parity.json: timings (tokens/s) differ run to run, so they go to the metrics and the manifest, never here."""
    from reprotune import manifest as mf

    mf.write_json(path, {**{k: v for k, v in report.items() if k != "tokens_per_second"},
                         "ladder": [{k: v for k, v in r.items() if k != "tokens_per_second"}
                                    for r in report["ladder"]]})


def write_metrics(export_dir: Path, report: dict[str, Any], serve_quant: str) -> None:
    """Numbers only (dvc metrics show/diff): one entry per quant tried, and the ladder's plot; the table with its
    words is parity.json's ladder (tokens/s is a timing: the manifest's, so identical runs give identical bytes)."""
    from reprotune import manifest as mf

    export_dir.mkdir(parents=True, exist_ok=True)
    metrics = {r["quant"]: {**{k: v for k, v in r.items() if k not in ("quant", "passed", "tokens_per_second")},
                            "passed": int(r["passed"]), "served": int(r["quant"] == serve_quant)}
               for r in report["ladder"]}
    mf.write_json(export_dir / "gguf_metrics.json", metrics)
    gq.plot_ladder(report["ladder"], export_dir / "quant_ladder.png", report["task"].get("metric"))


def write_manifest(run: Export, report: dict[str, Any], files: dict[str, str], imatrix: dict[str, Any] | None,
                   started: float) -> dict[str, Any]:
    """outputs/export/gguf_manifest.json: the build, what was read and written (sha256), the choice, the timings."""
    from reprotune import manifest as mf

    cfg = run.cfg
    root, final = run.resolved.path("root"), run.final
    prepared = run.resolved.path("prepared")
    manifest_path = run.resolved.path("export_dir") / "gguf_manifest.json"
    record = mf.stage_record("gguf", cfg, manifest_path, root, **{
        "seeds": {"seed": int(cfg.seed)},
        "llama_cpp": llama_cpp_record(run.src, imatrix is not None),
        "inputs": {"merged": mf.path_record(run.merged, root),
                   "holdout": mf.path_record(prepared / "holdout.jsonl", root),
                   "train_data": mf.path_record(prepared / "train.jsonl", root),
                   **({"imatrix_data": imatrix["data"]} if imatrix else {})},
        "outputs": {**{name: {**mf.path_record(final / f, root), "bytes": (final / f).stat().st_size}
                       for name, f in files.items()},
                    **({"imatrix": mf.path_record(final / gq.IMATRIX_FILE, root)} if imatrix else {}),
                    "parity": mf.path_record(final / "parity.json", root),
                    "modelfile": mf.path_record(final / "Modelfile", root)},
        "quality": {"served": report["serve_quant"], "chosen": report["chosen_quant"],
                    "tokens_per_second": report["tokens_per_second"]},
        "load_warnings": run.load_warnings,
        "timing": {**run.timing, "wall_seconds": round(time.time() - started, 2)},
    })
    mf.write_json(manifest_path, record)
    return record


def llama_cpp_record(src: Path, with_tools: bool) -> dict[str, Any]:
    """The llama.cpp build that made the files (and the sha256 of the tools' folder when the imatrix path used it)."""
    from reprotune import manifest as mf

    return {"llama_cpp_python": llamacpp.version(), "source": str(src), "system_info": llamacpp.system_info(),
            "lock_sha256": mf.sha256_file(llamacpp.REPO / "lockfiles/llama-cpp.txt"),
            **({"tools_sha256": gq.tool_files_sha256(src)}
               if with_tools else {})}


def make_imatrix(cfg: DictConfig, resolved: Run, src: Path, tokenizer: Any, f16: Path, out_dir: Path,
                 n_threads: int) -> dict[str, Any]:
    """llama-imatrix on the training split (prompts and answers, export.imatrix.max_tokens of them) into
    out_dir/imatrix.gguf; what it read is hashed (the text itself stays out of the outputs)."""
    import hashlib
    import shutil

    max_tokens, chunk = gq.imatrix_settings(cfg.export.imatrix)
    train_path = resolved.path("prepared") / "train.jsonl"
    conversations = (export_conversations(train_path) if resolved.objective.preference
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
            "data": {"source": os.path.relpath(train_path, resolved.paths["root"]),
                     "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}}


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
        run = resolve(cfg, "gguf")
        gguf(cfg, run)


if __name__ == "__main__":
    main()
