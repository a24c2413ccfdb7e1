"""How good a quantized GGUF is, and which one to ship (used by reprotune.gguf).

- The importance matrix: llama.cpp's own `llama-imatrix` (the pinned build's tool, scripts/build_llama_cpp.sh) on
  the training prompts and answers (the prepared, scrubbed train split, rendered as the model saw them, a bounded
  number of tokens), then `llama-quantize --imatrix` (the tool reads the file with llama.cpp's common loader; the C
  API takes the matrix only as arrays already read).
- The gate: each quant's greedy answers against the merged HF model's (exact answers, token agreement) and its
  task metric on the holdout against the merged model's; below export.parity.min_* it is marked failed.
- The ladder (export.quant=auto): quantize up export.ladder and keep the smallest quant that passes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError

IMATRIX_FILE = "imatrix.gguf"
IMATRIX_DATA = "imatrix-data.txt"  # the name the imatrix records as its dataset (relative: same bytes anywhere)
AUTO = "auto"


# ---------------------------------------------------------------------------------------------- tools
def tool(src: Path, name: str) -> Path:
    """A llama.cpp tool of the pinned build: <cache>/<version>-<key>/tools/bin/<name>, next to the wheel's build
    (src is <cache>/<version>-<key>/src/llama_cpp_python-<version>/vendor/llama.cpp)."""
    path = src.parents[3] / "tools" / "bin" / name
    if not path.is_file():
        raise ReprotuneError(f"gguf: {path} not found; run 'make llama-cpp' (scripts/build_llama_cpp.sh builds "
                             f"{name} once, cached next to the wheel)")
    return path


def tool_files_sha256(src: Path) -> dict[str, str]:
    """sha256 of every file of the tools' folder: the two tools and the libraries they load from it (libllama,
    libggml, libllama-common, libllama-quantize-impl: the quantize logic is in the latter), symbolic links left out."""
    from reprotune import manifest as mf

    folder = tool(src, "llama-quantize").parent
    return {p.name: mf.sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and not p.is_symlink()}


def run_tool(cmd: Sequence[str], cwd: Path, what: str) -> str:
    """Run a llama.cpp tool; its output is returned, and its last lines name the failure if it fails."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace")
    if proc.returncode != 0:
        tail = [line for line in proc.stdout.splitlines() if line.strip()][-3:] or ["(no output)"]
        raise ReprotuneError(f"gguf: {what} failed (exit {proc.returncode}): {' | '.join(tail)}")
    return proc.stdout


# -------------------------------------------------------------------------------------------- imatrix
def calibration_text(conversations: Sequence[list[dict] | str], tokenizer: Any, max_tokens: int
                     ) -> tuple[str, int, int]:
    """The training conversations as the model saw them (its chat template; text rows as they are), in file
    order, up to max_tokens tokens: (text, tokens, conversations used)."""
    pieces: list[str] = []
    total = 0
    for conv in conversations:
        text = conv if isinstance(conv, str) else tokenizer.apply_chat_template(conv, tokenize=False)
        n = len(tokenizer(text=text, add_special_tokens=False)["input_ids"])
        if pieces and total + n > max_tokens:
            break
        pieces.append(text)
        total += n
    return "".join(pieces), total, len(pieces)


def imatrix_settings(cfg_imatrix: Mapping[str, Any]) -> tuple[int, int]:
    max_tokens, chunk = int(cfg_imatrix["max_tokens"]), int(cfg_imatrix["chunk"])
    if chunk < 16 or max_tokens < 2 * chunk:
        raise ReprotuneError(f"export.imatrix: max_tokens ({max_tokens}) must be at least twice chunk ({chunk}), "
                             "and chunk at least 16 (llama-imatrix needs two chunks)")
    return max_tokens, chunk


def compute_imatrix(src: Path, f16: Path, text: str, work: Path, out: Path, chunk: int, threads: int,
                    process_output: bool) -> dict[str, Any]:
    """llama-imatrix on the calibration text (written to work/, a scratch folder: it is training data and does not
    ship); the file records the dataset by its relative name, so the bytes do not depend on where it ran."""
    work.mkdir(parents=True, exist_ok=True)
    (work / IMATRIX_DATA).write_text(text, encoding="utf-8")
    cmd = [tool(src, "llama-imatrix"), "-m", f16.resolve(), "-f", IMATRIX_DATA, "-o", out.resolve(),
           "-c", str(chunk), "-b", str(chunk), "--no-ppl", "--parse-special", "-t", str(threads), "-lv", "1",
           "--output-frequency", "1000000", *(["--process-output"] if process_output else [])]
    log = run_tool(cmd, work, "llama-imatrix")
    if not out.is_file():
        raise ReprotuneError(f"gguf: llama-imatrix wrote no {out.name}: {log.strip().splitlines()[-1:]}")
    return {"chunk": chunk, "process_output": process_output}


def quantize_with_tool(src: Path, work: Path, f16_name: str, out_name: str, quant: str, threads: int,
                       imatrix: str | None, token_embedding_type: str | None,
                       tensor_types: Mapping[str, str] | None = None) -> str:
    """llama-quantize in work/ (relative names: the GGUF records the imatrix file by the name it was given);
    tensor_types: {regex of tensor names: ggml type}, each a --tensor-type (the recipe's choice for the others)."""
    cmd: list[Any] = [tool(src, "llama-quantize")]
    if imatrix:
        cmd += ["--imatrix", imatrix]
    if token_embedding_type:
        cmd += ["--token-embedding-type", token_embedding_type]
    for pattern, type_name in (tensor_types or {}).items():
        cmd += ["--tensor-type", f"{pattern}={type_name}"]
    cmd += [f16_name, out_name, quant, str(threads)]
    return run_tool(cmd, work, f"llama-quantize {quant}")


def tensor_types(setting: Sequence[str] | None) -> dict[str, str]:
    """export.tensor_types, checked: a list of 'PATTERN=TYPE' as llama-quantize's --tensor-type takes them (PATTERN
    a regular expression searched in each tensor name, e.g. 'attn_v=q8_0', 'token_embd=q8_0'): {pattern: type}."""
    import re

    out: dict[str, str] = {}
    for item in setting or []:
        pattern, sep, type_name = str(item).rpartition("=")
        if not sep or not pattern:
            raise ReprotuneError(f"export.tensor_types: {item!r} is not PATTERN=TYPE (e.g. attn_v=q8_0)")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ReprotuneError(f"export.tensor_types: {pattern!r} is not a regular expression ({err})") from None
        if type_name.upper() not in GGML_TYPES:
            raise ReprotuneError(f"export.tensor_types: {item!r}: unknown ggml type {type_name!r} "
                                 f"(one of {', '.join(t.lower() for t in GGML_TYPES)})")
        out[pattern] = type_name.lower()
    return out


# the tensor types llama-quantize's --tensor-type takes (its own list, tools/quantize: a quantized or float type)
GGML_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K",
              "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")


# ----------------------------------------------------------------------------------------------- gate
def task_scores(answers: Sequence[str], references: Sequence[str], task: Mapping[str, Any]) -> dict[str, float]:
    """The eval stage's metrics (reprotune.metrics) of the answers against the holdout references, averaged."""
    from reprotune import metrics as mx

    names = mx.metric_names(task)
    return mx.mean_scores([mx.score(a, r, task) for a, r in zip(answers, references, strict=True)], names)


def gate(greedy: Mapping[str, Any], task: Mapping[str, float] | None, reference_task: Mapping[str, float] | None,
         primary: str | None, parity_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Pass or fail one GGUF: exact greedy answers, token agreement and the task's primary metric against the
    merged HF model's, each against its export.parity threshold; `failed` names what fell short."""
    min_exact, min_agree = float(parity_cfg["min_exact_match"]), float(parity_cfg["min_token_agreement"])
    max_drop = float(parity_cfg["max_task_metric_drop"])
    failed = []
    if greedy["exact_match_rate"] < min_exact:
        failed.append(f"exact answers {greedy['exact_match_rate']:.1%} < {min_exact:.1%}")
    if greedy["token_prefix_agreement"] < min_agree:
        failed.append(f"token agreement {greedy['token_prefix_agreement']:.1%} < {min_agree:.1%}")
    drop = None
    if task is not None and reference_task is not None and primary is not None:
        drop = reference_task[primary] - task[primary]
        if drop > max_drop + 1e-9:
            failed.append(f"{primary} {task[primary]:.3f} is {drop:.3f} below the merged model's "
                          f"{reference_task[primary]:.3f} (> {max_drop})")
    return {"passed": not failed, "failed": failed, "task_metric": primary,
            "task_metric_drop": None if drop is None else round(drop, 6),
            "thresholds": {"min_exact_match": min_exact, "min_token_agreement": min_agree,
                           "max_task_metric_drop": max_drop}}


def ladder(quant: Any, steps: Sequence[str]) -> list[str]:
    """The quants to try: export.quant as listed, or export.ladder (smallest first) for export.quant=auto."""
    if isinstance(quant, str) and quant == AUTO:
        if not steps:
            raise ReprotuneError("export.ladder: export.quant=auto needs at least one quant to try")
        return [str(q) for q in steps]
    return [str(quant)] if isinstance(quant, str) else [str(q) for q in quant]


def choose(results: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> str | None:
    """The first quant in `order` (smallest first) whose gate passed, or None."""
    return next((q for q in order if q in results and results[q]["gate"]["passed"]), None)


def auto_fallback(chosen: str | None, base: str, gates: Mapping[str, Mapping[str, Any]]) -> str | None:
    """export.quant=auto's pick: the smallest quant that passed; when none did, the unquantized file (F16) if it
    passed, so that make serve serves a model that answers like the trained one (at its full size) rather than a
    small one that does not; else None (the largest quant tried ships, marked failed)."""
    if chosen is not None:
        return chosen
    return base if base in gates and gates[base]["passed"] else None


def summary_line(name: str, filename: str, size: int, greedy: Mapping[str, Any], gate_: Mapping[str, Any],
                 task: Mapping[str, float] | None, tokens_per_s: float | None) -> str:
    """One line per quant for make gguf: the numbers and the verdict."""
    metric = gate_.get("task_metric")
    task_s = f", {metric} {task[metric]:.3f}" if task is not None and metric else ""
    speed = f", {tokens_per_s:.1f} tok/s" if tokens_per_s else ""
    verdict = "PASS" if gate_["passed"] else "FAIL (" + "; ".join(gate_["failed"]) + ")"
    return (f"gguf: {filename} ({size / 2**20:.1f} MiB{speed}): exact {greedy['exact_matches']}/{greedy['prompts']}"
            f", tokens {greedy['token_prefix_agreement']:.1%}{task_s}: {verdict}")


def plot_ladder(rows: Sequence[Mapping[str, Any]], out: Path, metric: str | None) -> None:
    """Size against parity (and the task metric) for every quant tried, as a png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from reprotune.io import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    sizes = [r["mib"] for r in rows]
    ax.plot(sizes, [r["exact_match_rate"] for r in rows], "o-", label="exact greedy answers")
    ax.plot(sizes, [r["token_agreement"] for r in rows], "s--", label="token agreement")
    if metric and rows:
        ax.plot(sizes, [r["task_metric"] for r in rows], "^:", label=f"{metric} (HF merged: dotted line)")
        ax.axhline(rows[0]["reference_task_metric"], color="grey", linestyle=":", linewidth=1)
    for r in rows:
        ax.annotate(f"{r['quant']}{'' if r['passed'] else ' (failed)'}", (r["mib"], r["exact_match_rate"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("vs the merged HF model")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("GGUF quants tried (smallest first)")
    save_figure(fig, out)
    plt.close(fig)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
