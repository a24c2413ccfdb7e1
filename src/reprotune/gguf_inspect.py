"""Print a GGUF file's tensor type mix and tokenizer metadata as one JSON line, read with llama.cpp's vendored
gguf-py (not the PyPI gguf that transformers uses: the two may differ, and must never share a process).

    python -m reprotune.gguf_inspect <llama.cpp source dir>/gguf-py <file.gguf>

reprotune.llamacpp.gguf_info runs this in a subprocess; it imports nothing else from reprotune.
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

KEYS = ["general.architecture", "general.name", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template"]


def inspect(gguf_py: str, path: str) -> dict[str, Any]:
    sys.path.insert(0, gguf_py)  # ahead of any installed gguf
    from gguf import GGUFReader

    reader = GGUFReader(path)
    counts: collections.Counter[str] = collections.Counter()
    sizes: collections.Counter[str] = collections.Counter()
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] += 1
        sizes[tensor.tensor_type.name] += int(tensor.n_bytes)

    def field(name: str) -> Any:
        found = reader.fields.get(name)
        return None if found is None else found.contents()

    return {"tensors": len(reader.tensors), "type_counts": dict(counts), "type_bytes": dict(sizes),
            "metadata": {k: field(k) for k in KEYS}}


if __name__ == "__main__":
    print(json.dumps(inspect(sys.argv[1], sys.argv[2])))
