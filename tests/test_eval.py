"""Eval stage on a tiny trained adapter: outputs, determinism, the base pass, batching, bad input, DVC."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.evaluate import evaluate

from .eval_support import eval_overrides, tiny_adapter  # noqa: F401 (fixture)

OUTPUTS = ("metrics.json", "predictions.jsonl", "report.md", "comparison.png", "manifest.json")


@pytest.fixture(scope="module")
def evaluated(tiny_adapter: Path) -> tuple[Path, dict]:  # noqa: F811
    result = evaluate(compose(eval_overrides(tiny_adapter, "eval_a")))
    return tiny_adapter / "eval_a", result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_outputs_and_metrics(evaluated: tuple[Path, dict]) -> None:
    out, result = evaluated
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["examples"] == 6
    records = read_jsonl(out / "predictions.jsonl")
    for system in ("base", "tuned"):
        for name in ("json_valid", "exact_match", "field_accuracy", "schema_ok", "field/total", "amounts_ok",
                     "iso_date"):
            # the table's number is the mean of the per-example scores written next to it
            per_example = [r["scores"][system][name] for r in records if name in r["scores"][system]]
            assert per_example, (system, name)
            assert metrics[system][name] == pytest.approx(sum(per_example) / len(per_example), abs=2e-6), (system, name)
        assert metrics[system]["loss"] > 0
        assert metrics[system]["perplexity"] == pytest.approx(math.exp(metrics[system]["loss"]), rel=1e-5)
    delta = metrics["delta_tuned_vs_base"]
    assert delta["loss"] == pytest.approx(metrics["tuned"]["loss"] - metrics["base"]["loss"], abs=2e-6)
    assert "baseline" not in metrics  # no endpoint configured, nothing sent anywhere
    assert "seconds" not in json.dumps(metrics)  # timings live in the manifest only
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "eval" and manifest["device"] == "cpu" and manifest["batch_size"] == 4
    assert manifest["timing"]["base"]["seconds"] > 0 and manifest["timing"]["tuned"]["seconds"] > 0
    assert manifest["outputs"]["metrics"]["sha256"] == __import__("hashlib").sha256(
        (out / "metrics.json").read_bytes()).hexdigest()
    assert manifest["outputs"]["report"]["path"] == "eval_a/report.md"  # relative to paths.root
    assert manifest["manifest_path"] == "eval_a/manifest.json"
    assert manifest["inputs"]["holdout"] == {"path": "data/prepared/holdout.jsonl", "examples": 6,
                                             "sha256": manifest["inputs"]["holdout"]["sha256"]}
    assert len(manifest["inputs"]["holdout"]["sha256"]) == 64
    assert set(manifest["inputs"]["adapter"]["files"]) >= {"adapter_model.safetensors", "chat_template.jinja"}
    assert manifest["baseline"] is None


def test_predictions_hold_every_example_and_system(evaluated: tuple[Path, dict], tiny_adapter: Path) -> None:  # noqa: F811
    out, _ = evaluated
    records = read_jsonl(out / "predictions.jsonl")
    holdout = read_jsonl(tiny_adapter / "data/prepared/holdout.jsonl")[:6]
    assert [r["index"] for r in records] == list(range(6))
    for record, row in zip(records, holdout, strict=True):
        assert record["reference"] == row["messages"][-1]["content"]
        assert record["input"] == row["messages"][1]["content"]
        assert set(record["predictions"]) == set(record["scores"]) == {"base", "tuned"}
        assert record["reference_loss"]["base"] > 0
    # the adapter is really applied in the tuned pass: it changes the loss of every reference, and replies
    assert all(r["reference_loss"]["tuned"] != r["reference_loss"]["base"] for r in records)
    assert any(r["predictions"]["tuned"] != r["predictions"]["base"] for r in records)


def test_report_shows_table_and_differing_examples(evaluated: tuple[Path, dict]) -> None:
    out, _ = evaluated
    report = (out / "report.md").read_text()
    assert "| metric | base | tuned | Δ tuned − base |" in report
    assert "| field_accuracy |" in report and "| loss (lower is better) |" in report
    records = read_jsonl(out / "predictions.jsonl")
    differ = [r for r in records if r["predictions"]["base"] != r["predictions"]["tuned"]]
    assert f"Where base and tuned differ ({len(differ)} of 6" in report
    assert report.count("### Example ") == len(differ)
    # worst regression first: the shown deltas never decrease down the page
    deltas = [r["scores"]["tuned"]["field_accuracy"] - r["scores"]["base"]["field_accuracy"] for r in differ]
    shown = [int(line.split()[2].rstrip(":")) - 1 for line in report.splitlines() if line.startswith("### Example")]
    assert [deltas[[r["index"] for r in differ].index(i)] for i in shown] == sorted(deltas)


@pytest.mark.slow  # full lane: a second eval run
def test_rerun_is_byte_identical(evaluated: tuple[Path, dict], tiny_adapter: Path) -> None:  # noqa: F811
    out, _ = evaluated
    evaluate(compose(eval_overrides(tiny_adapter, "eval_b")))
    for name in ("metrics.json", "predictions.jsonl", "report.md", "comparison.png"):
        assert (tiny_adapter / "eval_b" / name).read_bytes() == (out / name).read_bytes(), name


def test_base_pass_is_the_plain_base_model(evaluated: tuple[Path, dict], tiny_adapter: Path) -> None:  # noqa: F811
    """disable_adapter() really gives the base model back: compare with the base loaded without PEFT,
    one example, no batch and no padding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reprotune.models import resolve_model_dir

    out, _ = evaluated
    cfg = compose(eval_overrides(tiny_adapter, "unused"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_adapter / "outputs/adapter")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache)).eval()
    row = read_jsonl(tiny_adapter / "data/prepared/holdout.jsonl")[0]["messages"]
    prompt = tokenizer.apply_chat_template(row[:-1], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    target = tokenizer.encode(row[-1]["content"] + "<|im_end|>", add_special_tokens=False)
    with torch.inference_mode():
        generated = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=24,
                                   pad_token_id=tokenizer.pad_token_id)
        loss = model(torch.tensor([prompt_ids + target]),
                     labels=torch.tensor([[-100] * len(prompt_ids) + target])).loss.item()
    record = read_jsonl(out / "predictions.jsonl")[0]
    expected = tokenizer.decode(generated[0, len(prompt_ids):], skip_special_tokens=True).strip()
    assert record["predictions"]["base"] == expected
    assert record["reference_loss"]["base"] == pytest.approx(loss, abs=1e-4)
    assert abs(record["reference_loss"]["tuned"] - loss) > 1e-3


@pytest.mark.slow  # full lane: a second eval run at batch size 1
def test_batching_does_not_change_predictions(evaluated: tuple[Path, dict], tiny_adapter: Path) -> None:  # noqa: F811
    """Left padding is right: one example at a time gives the same greedy replies as batches of 4."""
    out, _ = evaluated
    evaluate(compose(eval_overrides(tiny_adapter, "eval_bs1", "eval.batch_size=1", "eval.loss=false")))
    single = read_jsonl(tiny_adapter / "eval_bs1/predictions.jsonl")
    batched = read_jsonl(out / "predictions.jsonl")
    assert [r["predictions"] for r in single] == [r["predictions"] for r in batched]
    assert "loss" not in json.loads((tiny_adapter / "eval_bs1/metrics.json").read_text())["base"]


@pytest.mark.slow  # full lane: an eval run in its own process (test_holdout_validation checks the messages in process)
def test_bad_holdout_line_is_one_clear_error(tiny_adapter: Path, tmp_path: Path) -> None:  # noqa: F811
    """Run as the CLI: exit code, one line naming file, line and field, and earlier outputs left alone."""
    rows = read_jsonl(tiny_adapter / "data/prepared/holdout.jsonl")[:3]
    rows[2] = {"conversation": rows[2]["messages"]}
    holdout = tmp_path / "data/prepared/holdout.jsonl"
    holdout.parent.mkdir(parents=True)
    holdout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    earlier = tmp_path / "outputs/eval/metrics.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"earlier": 1}\n')
    env = {**os.environ, "PYTHONPATH": str(Path("src").resolve())}
    proc = subprocess.run([sys.executable, "-m", "reprotune.evaluate", "model=tiny_random", f"paths.root={tmp_path}",
                           f"paths.adapter={tiny_adapter / 'outputs/adapter'}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"{holdout}:3: messages: must be a list of at least 2 messages"
    assert "Traceback" not in proc.stderr
    assert earlier.read_text() == '{"earlier": 1}\n'


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r":1: json: not valid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}',
     r":1: messages\[-1\].role: must be 'assistant'"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', r":1: messages\[0\]: needs string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "not json"}]}',
     r"holdout.jsonl:1: messages\[-1\].content: the reference answer is not a JSON object, but data.task.type is "
     r"json; for free-text answers set data.task.type=text \(or auto: inferred from the answers\)$"),
])
def test_holdout_validation(line: str, message: str, tmp_path: Path) -> None:
    holdout = tmp_path / "data/prepared/holdout.jsonl"
    holdout.parent.mkdir(parents=True)
    holdout.write_text(line + "\n")
    with pytest.raises(ReprotuneError, match=message):
        evaluate(compose(["model=tiny_random", f"paths.root={tmp_path}", "data.task.type=json"]))
    assert not (tmp_path / "outputs").exists()


def test_missing_adapter_says_make_train(workspace: tuple[Path, list[str]]) -> None:
    _, overrides = workspace
    with pytest.raises(ReprotuneError, match="adapter_config.json: file: not found; run 'make train' first"):
        evaluate(compose(["model=tiny_random", *overrides]))


def test_dvc_stage_declares_exactly_what_eval_writes(evaluated: tuple[Path, dict], tmp_path: Path) -> None:
    """The eval stage's outs/metrics/plots are the files the module writes; dvc metrics/plots show read them."""
    out, _ = evaluated
    stage = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]["eval"]
    declared = [next(iter(e)) if isinstance(e, dict) else e
                for key in ("outs", "metrics", "plots") for e in stage[key]]
    assert sorted(Path(p).name for p in declared) == sorted(OUTPUTS)
    assert all(p.startswith("outputs/eval/") for p in declared)
    deps = set(stage["deps"])
    assert {"data/prepared/holdout.jsonl", "outputs/adapter", "src/reprotune/evaluate.py",
            "src/reprotune/metrics.py"} <= deps
    assert all(Path(d).exists() for d in deps if d.startswith("src/"))

    # a scratch DVC project holding just this stage and the outputs of the run above
    dvc = str(Path(sys.executable).with_name("dvc"))
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"eval": stage}}))
    shutil.copytree(out, tmp_path / "outputs/eval")
    shown = subprocess.run([dvc, "metrics", "show", "--json"], cwd=tmp_path, capture_output=True, text=True,
                           check=True)
    data = json.loads(shown.stdout)
    values = next(iter(data.values()))["data"]["outputs/eval/metrics.json"]["data"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert values["tuned"]["field_accuracy"] == metrics["tuned"]["field_accuracy"]
    assert values["delta_tuned_vs_base"]["loss"] == metrics["delta_tuned_vs_base"]["loss"]
    plots = subprocess.run([dvc, "plots", "show", "--json"], cwd=tmp_path, capture_output=True, text=True,
                           check=True)
    assert "outputs/eval/comparison.png" in plots.stdout


@pytest.mark.slow
def test_smollm2_short_run_end_to_end(smollm2_run: tuple[Path, list[str]], tmp_path: Path) -> None:
    """The built-in model: a short adapter (conftest's shared smollm2_run, 12 steps of 2 rows) lowers the holdout
    loss, and batching (left padding) gives the same greedy replies as one example at a time."""
    _, root = smollm2_run  # read-only: the evaluations write to tmp_path
    # three invoices of different lengths (left padding in the batch of three), 64 tokens: most of each JSON answer
    common = [*root, "eval.max_examples=3", "eval.max_new_tokens=64"]
    metrics = evaluate(compose([*common, "eval.batch_size=3", f"paths.eval_dir={tmp_path / 'a'}"]))["metrics"]
    evaluate(compose([*common, "eval.batch_size=1", "eval.loss=false", f"paths.eval_dir={tmp_path / 'b'}"]))
    assert metrics["tuned"]["loss"] < metrics["base"]["loss"]
    batched, single = (read_jsonl(tmp_path / d / "predictions.jsonl") for d in ("a", "b"))
    assert [r["predictions"] for r in batched] == [r["predictions"] for r in single]
    assert all(r["predictions"]["base"] and r["predictions"]["tuned"] for r in batched)  # real text, not empty


@pytest.mark.slow  # full lane: three eval runs
def test_a_failure_while_writing_keeps_the_previous_set(tiny_adapter: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The five files appear as one set (#22): a failure after predictions, metrics and the report were written
    (the plot fails, as a full disk would) leaves the previous five byte for byte; the next good run swaps in a
    whole new set whose manifest hashes the files that are there."""
    import hashlib

    from reprotune.evaluation import report as ev  # write_outputs calls its plot_comparison

    out = tiny_adapter / "eval_atomic"
    evaluate(compose(eval_overrides(tiny_adapter, "eval_atomic")))
    before = {name: (out / name).read_bytes() for name in OUTPUTS}

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(ev, "plot_comparison", disk_full)
        with pytest.raises(OSError, match="No space left"):
            evaluate(compose(eval_overrides(tiny_adapter, "eval_atomic", "eval.max_examples=4")))
    assert {name: (out / name).read_bytes() for name in OUTPUTS} == before
    # the failed run had written different files (4 examples, not 6) before it failed: a one-by-one write
    # would have left them in place of the old ones
    staged = out.with_name("eval_atomic.tmp")
    assert (staged / "predictions.jsonl").read_bytes() != before["predictions.jsonl"]
    assert (staged / "metrics.json").is_file() and (staged / "report.md").is_file()

    evaluate(compose(eval_overrides(tiny_adapter, "eval_atomic", "eval.max_examples=4")))
    assert not staged.exists()
    assert json.loads((out / "metrics.json").read_text())["examples"] == 4
    manifest = json.loads((out / "manifest.json").read_text())
    for record in manifest["outputs"].values():
        path = tiny_adapter / record["path"]
        assert path.parent == out and record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert all((out / name).read_bytes() != before[name] for name in ("predictions.jsonl", "metrics.json"))
