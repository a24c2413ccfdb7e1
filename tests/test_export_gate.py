"""The parity gate and the quant ladder of make gguf, on real GGUFs of the tiny random model (the shared tiny export
of export_pipeline: Q4_K_M and Q8_0 made with the imatrix), and make serve's refusal of a quant that failed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reprotune import gguf_quality as gq
from reprotune.config import compose
from reprotune.errors import ReprotuneError

from .export_pipeline import tiny_export

pytestmark = pytest.mark.slow  # needs the llama.cpp build (compiled on first use)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return tiny_export(tmp_path_factory, upto="gguf")


def report_of(root: Path) -> dict:
    return json.loads((root / "outputs/gguf/parity.json").read_text())


def test_every_gguf_gets_a_verdict_from_its_numbers(exported: tuple[Path, list[str]]) -> None:
    """parity.json has a gate verdict for F16 and each quant, and it is the gate's function of the numbers next to
    it: the same thresholds pass exactly at the measured values and fail just above them."""
    root, overrides = exported
    report = report_of(root)
    parity = compose(overrides).export.parity
    assert set(report["gate"]) == {"F16", "Q4_K_M", "Q8_0"}
    metric = report["task"]["metric"]
    assert metric == "field_accuracy" and set(report["task"]) == {"metric", "hf_merged", "F16", "Q4_K_M", "Q8_0"}
    for name, verdict in report["gate"].items():
        greedy, task = report["greedy"][name], report["task"][name]
        assert verdict == gq.gate(greedy, task, report["task"]["hf_merged"], metric, parity)
        at = {"min_exact_match": greedy["exact_match_rate"], "min_token_agreement": greedy["token_prefix_agreement"],
              "max_task_metric_drop": max(0.0, report["task"]["hf_merged"][metric] - task[metric])}
        assert gq.gate(greedy, task, report["task"]["hf_merged"], metric, at)["passed"]
        above = {**at, "min_token_agreement": greedy["token_prefix_agreement"] + 1e-6}
        failed = gq.gate(greedy, task, report["task"]["hf_merged"], metric, above)
        assert not failed["passed"] and failed["failed"][0].startswith("token agreement")
    # explicit list: the Modelfile and make serve use the first listed
    assert report["serve_quant"] == "Q4_K_M" and report["modelfile"]["from"] == "model-Q4_K_M.gguf"
    assert [r["quant"] for r in report["ladder"]] == ["Q4_K_M", "Q8_0"]
    metrics = json.loads((root / "outputs/export/gguf_metrics.json").read_text())
    assert metrics["Q4_K_M"]["served"] == 1 and metrics["Q8_0"]["served"] == 0
    assert metrics["Q4_K_M"]["bytes"] < metrics["Q8_0"]["bytes"]
    assert (root / "outputs/export/quant_ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_choose_takes_the_smallest_that_passes() -> None:
    results = {"Q4_K_M": {"gate": {"passed": False}}, "Q5_K_M": {"gate": {"passed": True}},
               "Q8_0": {"gate": {"passed": True}}}
    assert gq.choose(results, ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]) == "Q5_K_M"
    assert gq.choose({"Q4_K_M": {"gate": {"passed": False}}}, ["Q4_K_M"]) is None
    assert gq.ladder("auto", ["Q4_K_M", "Q8_0"]) == ["Q4_K_M", "Q8_0"]
    assert gq.ladder(["Q8_0"], []) == ["Q8_0"]
    with pytest.raises(ReprotuneError, match="export.ladder: export.quant=auto needs at least one quant"):
        gq.ladder("auto", [])
    # auto with no quant passing: the F16 file when it passed (it answers like the model), else nothing
    gates = {"F16": {"passed": True}, "Q8_0": {"passed": False}}
    assert gq.auto_fallback(None, "F16", gates) == "F16"
    assert gq.auto_fallback("Q8_0", "F16", gates) == "Q8_0"
    assert gq.auto_fallback(None, "F16", {**gates, "F16": {"passed": False}}) is None


def test_auto_ladder_none_passing_and_serve_refusal(exported: tuple[Path, list[str]], tmp_path: Path) -> None:
    """export.quant=auto with a gate nothing can pass: every rung is tried, only the largest ships, marked failed;
    make serve refuses it in one line naming the setting, and serves it with export.serve.allow_failed=true. The
    imatrix of this second run is byte-identical to the shared run's (same F16, same data, same build), and so is
    the Q8_0 made with it."""
    from reprotune.gguf import gguf
    from reprotune.serve import llama_cpp_settings

    root, overrides = exported
    for part in ("data/prepared", "outputs/merged"):
        shutil.copytree(root / part, tmp_path / part)
    args = [*overrides, f"paths.root={tmp_path}", "export.quant=auto", "export.ladder=[Q4_K_M,Q8_0]",
            "export.parity.min_token_agreement=1.01"]
    gguf(compose(args))
    report = report_of(tmp_path)
    assert [r["quant"] for r in report["ladder"]] == ["Q4_K_M", "Q8_0"]
    assert not any(r["passed"] for r in report["ladder"]) and report["chosen_quant"] is None
    assert report["serve_quant"] == "Q8_0" and report["modelfile"]["from"] == "model-Q8_0.gguf"
    assert not (tmp_path / "outputs/gguf/model-Q4_K_M.gguf").exists()
    out, shared = tmp_path / "outputs/gguf", root / "outputs/gguf"
    for name in ("imatrix.gguf", "model-Q8_0.gguf"):
        assert (out / name).read_bytes() == (shared / name).read_bytes(), name

    with pytest.raises(ReprotuneError, match=r"^serve: model-Q8_0.gguf failed the parity gate of make gguf "
                                             r"\(token agreement .*\); serve it anyway with "
                                             r"export.serve.allow_failed=true$"):
        llama_cpp_settings(compose([f"paths.root={tmp_path}"]))
    _, model = llama_cpp_settings(compose([f"paths.root={tmp_path}", "export.serve.allow_failed=true"]))
    assert model.model == str(out / "model-Q8_0.gguf")


def test_auto_ships_and_serves_the_first_rung_that_passes(exported: tuple[Path, list[str]], tmp_path: Path) -> None:
    """export.quant=auto with a gate the smallest rung passes: the ladder stops there (the larger rung is neither
    made nor tried), that quant ships, the Modelfile and make serve use it without export.serve.allow_failed, and
    gguf_metrics.json marks it served."""
    from reprotune.gguf import gguf
    from reprotune.serve import llama_cpp_settings

    root, overrides = exported
    for part in ("data/prepared", "outputs/merged"):
        shutil.copytree(root / part, tmp_path / part)
    args = [*overrides, f"paths.root={tmp_path}", "export.quant=auto", "export.ladder=[Q4_K_M,Q8_0]",
            "export.parity.min_exact_match=0", "export.parity.min_token_agreement=0",
            "export.parity.max_task_metric_drop=1"]
    gguf(compose(args))
    report = report_of(tmp_path)
    assert [r["quant"] for r in report["ladder"]] == ["Q4_K_M"] and report["ladder"][0]["passed"]
    assert report["chosen_quant"] == "Q4_K_M" and report["serve_quant"] == "Q4_K_M"
    assert report["modelfile"]["from"] == "model-Q4_K_M.gguf"
    out = tmp_path / "outputs/gguf"
    assert not (out / "model-Q8_0.gguf").exists() and "Q8_0" not in report["gate"]
    assert "FROM ./model-Q4_K_M.gguf" in (out / "Modelfile").read_text()
    metrics = json.loads((tmp_path / "outputs/export/gguf_metrics.json").read_text())
    assert metrics["Q4_K_M"]["served"] == 1
    _, model = llama_cpp_settings(compose([f"paths.root={tmp_path}"]))
    assert model.model == str(out / "model-Q4_K_M.gguf")


def test_tensor_types_are_checked_one_line_each() -> None:
    """export.tensor_types: PATTERN=TYPE as llama-quantize's --tensor-type takes it; a malformed entry, a bad regex
    or an unknown type is one line naming the setting and the entry."""
    assert gq.tensor_types(["attn_v=q8_0", r"token_embd\.weight=Q6_K"]) == {"attn_v": "q8_0",
                                                                           r"token_embd\.weight": "q6_k"}
    assert gq.tensor_types(None) == {} and gq.tensor_types([]) == {}
    for bad, message in (("attn_v", r"'attn_v' is not PATTERN=TYPE"), ("=q8_0", r"'=q8_0' is not PATTERN=TYPE"),
                         ("attn_(v=q8_0", r"'attn_\(v' is not a regular expression"),
                         ("attn_v=q9_9", r"'attn_v=q9_9': unknown ggml type 'q9_9'")):
        with pytest.raises(ReprotuneError, match=rf"^export.tensor_types: {message}"):
            gq.tensor_types([bad])
