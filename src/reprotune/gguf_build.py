"""Making the GGUF files with the pinned llama.cpp (used by reprotune.gguf): convert the merged HF model, load
the result the way llama.cpp will (and fail on any warning that generation degrades), quantize it.

The failures users of other tools meet only after shipping are checked here, and each one stops the stage:
  - an unknown pre-tokenizer (the converter refuses; we say which hash and what to do);
  - any warning with which llama.cpp itself says generation will degrade, when it loads the GGUF;
  - an end-of-turn token of the HF generation config that llama.cpp does not treat as end of generation
    (answers that never stop).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from reprotune import llamacpp
from reprotune.errors import ReprotuneError

log = logging.getLogger("reprotune.gguf")


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
    if proc.wait() != 0:
        raise convert_error(captured.decode("utf-8", errors="replace"), merged)


def convert_error(text: str, merged: Path) -> ReprotuneError:
    """The converter's failure in one line: an unknown pre-tokenizer named by its hash, else its last line."""
    if "pre-tokenizer was not recognized" in text:
        chk = llamacpp.CHKHSH_RE.search(text)
        return ReprotuneError(
            f"gguf: llama.cpp {llamacpp.version()} does not know the pre-tokenizer of {merged}/tokenizer.json "
            f"(chkhsh {chk.group(1) if chk else '?'}); a GGUF with a guessed pre-tokenizer would tokenize "
            "differently from training. Use a llama.cpp that lists this tokenizer (lockfiles/llama-cpp.txt)")
    last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
    return ReprotuneError(f"gguf: convert_hf_to_gguf.py failed on {merged}: {last[0]}")


# ------------------------------------------------------------------------------------------ load checks
def load_vocab(path: Path) -> Any:
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


def eog_ids(vocab: Any) -> list[int]:
    """Token ids llama.cpp ends generation on (the end-of-turn set of the GGUF)."""
    import llama_cpp

    return [i for i in range(vocab.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab.vocab, i)]


def generation_eos(merged: Path) -> list[int]:
    """The eos ids of the merged model's generation config (one id or a list)."""
    import json

    gen_eos = json.loads((merged / "generation_config.json").read_text()).get("eos_token_id")
    return [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])


def check_stops(eog: list[int], gen_eos: list[int], name: str, merged: Path) -> None:
    """Every eos id of the generation config must end llama.cpp's generation too, or answers never end."""
    missing = [e for e in gen_eos if e not in eog]
    if missing:
        raise ReprotuneError(f"gguf: {name}: llama.cpp does not stop on eos id(s) {missing} of "
                             f"{merged}/generation_config.json; answers would never end")


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

    params = quantize_params(quant, n_threads, token_embedding_type, tensor_types)
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


def quantize_params(quant: str, n_threads: int, token_embedding_type: str | None,
                    tensor_types: dict[str, str] | None) -> Any:
    """llama_model_quantize_params as llama-quantize fills them for these options."""
    import llama_cpp

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
    return params
