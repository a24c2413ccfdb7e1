"""make gguf's checks that need no llama.cpp: the generation config's eos ids must all end llama.cpp's generation
(one line naming the ids otherwise), and a converter failure becomes one line (an unknown pre-tokenizer named by its
hash)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.errors import ReprotuneError
from reprotune.gguf_build import check_stops, convert_error, generation_eos


@pytest.mark.parametrize("eos, ids", [(2, [2]), ([2, 7], [2, 7]), (None, [])])
def test_generation_eos_reads_one_id_or_a_list(tmp_path: Path, eos: int | list[int] | None, ids: list[int]) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert generation_eos(tmp_path) == ids


def test_an_eos_llama_cpp_does_not_stop_on_is_refused_in_one_line(tmp_path: Path) -> None:
    check_stops([0, 2, 7], [2, 7], "model-F16.gguf", tmp_path)  # every eos ends generation: nothing to say
    with pytest.raises(ReprotuneError) as err:
        check_stops([0, 2], [2, 7], "model-F16.gguf", tmp_path)
    assert str(err.value) == (f"gguf: model-F16.gguf: llama.cpp does not stop on eos id(s) [7] of "
                              f"{tmp_path}/generation_config.json; answers would never end")


@pytest.mark.slow  # full lane: convert_error names the installed llama-cpp-python's version (make llama-cpp)
def test_converter_failures_are_one_line(tmp_path: Path) -> None:
    chk = "0123abcd" * 8
    text = (f"INFO:hf-to-gguf:Loading model\nWARNING:hf-to-gguf:** chkhsh:  {chk}\n"
            "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre()\n")
    message = str(convert_error(text, tmp_path))
    assert message.startswith("gguf: llama.cpp ") and "does not know the pre-tokenizer of " in message
    assert f"(chkhsh {chk})" in message and "\n" not in message
    assert str(convert_error("loading\nKeyError: 'hidden_size'\n\n", tmp_path)) == (
        f"gguf: convert_hf_to_gguf.py failed on {tmp_path}: KeyError: 'hidden_size'")
