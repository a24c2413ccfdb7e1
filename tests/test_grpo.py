"""Online RL (issue #47, first slice): objective=grpo through TRL's GRPOTrainer on the tiny model. The rewards
(built-ins scored as eval scores, a user's file imported at train's start only, a bad reward one line), the
prompts prepare writes (from SFT conversations, split as SFT's; TRL's prompt-only formats; file:line errors), and
two CPU runs giving the same adapter and the same rollouts, recorded in the manifest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.manifest import sha256_file
from reprotune.metrics import json_scores
from reprotune.rl import rewards as rw

from .conftest import small_invoices, write_jsonl

ANSWER = ('{"supplier": "Acme Ltd", "invoice_number": "INV-1", "date": "2024-01-02", "currency": "EUR", '
          '"total": 12.5, "tax": 2.5}')
ONE_WRONG = ANSWER.replace("2024-01-02", "2024-02-01")


def user(c: str) -> dict:
    return {"role": "user", "content": c}


def said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# --------------------------------------------------------------------------------------------------- rewards
def test_builtin_rewards_score_as_eval_scores() -> None:
    completions = [said(ANSWER), said(ONE_WRONG), said("```json\n" + ANSWER + "\n```"), said("no json here")]
    answers = [ANSWER] * 4
    assert rw.json_valid(completions) == [1.0, 1.0, 1.0, 0.0]
    assert rw.field_accuracy(completions, answer=answers) == [
        json_scores(c[0]["content"], ANSWER, [])["field_accuracy"] for c in completions]
    assert rw.field_accuracy(completions, answer=answers)[1] == pytest.approx(5 / 6)
    # a JSON answer: the same object, spacing and key order aside; text: normalised equality
    assert rw.exact_match(completions + [said(json.dumps(json.loads(ANSWER), indent=2))],
                          answer=answers + [ANSWER]) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert rw.exact_match(["  Paris ", "paris"], answer=["Paris", "Paris"]) == [1.0, 0.0]
    assert rw.exact_match(["  Paris ", "paris"], normalize="lower", answer=["Paris", "Paris"]) == [1.0, 1.0]


def test_generic_rewards_take_their_parameters() -> None:
    assert rw.regex(["total: 12", "none"], pattern=r"\d+") == [1.0, 0.0]
    assert rw.regex(["2024-01-02", "on 2024-01-02"], pattern=r"\d{4}-\d{2}-\d{2}", full=True) == [1.0, 0.0]
    # tokens: 1 from min to max, falling linearly to 0 at 0 and at 2 x max
    assert rw.length(["a"] * 5, completion_ids=[[1] * n for n in (2, 4, 8, 12, 20)], max=8, min=4) == \
        [0.5, 1.0, 1.0, 0.5, 0.0]
    schema = {"type": "object", "required": ["total"], "additionalProperties": False,
              "properties": {"total": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD"]}}}
    assert rw.json_schema(['{"total": 3}', '{"total": -1}', '{"total": 3, "x": 1}', '{"currency": "EUR"}',
                           '{"total": 1, "currency": "GBP"}', "[1]", "nope"], schema=schema) == \
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(("rewards", "message"), [
    ([], r"objective.rewards: a non-empty list"),
    (["json_vaild"], r"objective.rewards\[0\]: 'json_vaild' is not one of json_valid, field_accuracy"),
    ([{"name": "regex"}], r"objective.rewards\[0\].pattern: regex needs a pattern"),
    ([{"name": "regex", "pattern": "("}], r"objective.rewards\[0\].pattern: bad regex"),
    (["json_valid", {"name": "length", "max": 0}], r"objective.rewards\[1\].max: length needs integers"),
    ([{"name": "exact_match", "fields": ["a"]}], r"objective.rewards\[0\].fields: exact_match takes normalize, column"),
    ([{"name": "json_schema", "schema": {"type": "obj"}}], r"objective.rewards\[0\].schema.type: 'obj' is not one"),
    (["missing/file.py:score"], r"missing/file.py:0: objective.rewards\[0\]: 'missing/file.py:score': no such file"),
    (["json_valid", "json_valid"], r"objective.rewards: 'json_valid' twice"),
])
def test_bad_reward_specs_are_one_line(rewards: list, message: str) -> None:
    with pytest.raises(ReprotuneError, match=message):
        rw.check_rewards(rewards)


def test_reward_weights_must_match_the_rewards() -> None:
    with pytest.raises(ReprotuneError, match=r"objective.reward_weights: 1 weights for 2 rewards"):
        rw.check_rewards(["json_valid", "field_accuracy"], [1.0])


def test_a_users_reward_is_imported_only_when_loaded(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    file = tmp_path / "my_reward.py"
    file.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n"
                    "def shout(prompts, completions, bonus=0.0, **kw):\n"
                    "    return [float(c.isupper()) + bonus for c in completions]\n")
    specs = rw.check_rewards([{"name": f"{file}:shout", "bonus": 0.5}])  # what make plan and prepare run
    assert not marker.exists()
    funcs, loaded, rollouts = rw.load_rewards([{"name": f"{file}:shout", "bonus": 0.5}])
    assert marker.read_text() == "yes" and specs == loaded
    assert funcs[0].__name__ == "shout"  # TRL logs rewards/shout/mean
    assert funcs[0](prompts=["p", "q"], completions=["HI", "hi"]) == [1.5, 0.5]
    assert rollouts.rows()[1] == {"step": 0, "index": 1, "prompt": "q", "completion": "hi", "rewards": {"shout": 0.5}}
    assert rw.file_records(loaded, tmp_path)[0]["file"] == {"path": "my_reward.py", "sha256": sha256_file(file)}
    with pytest.raises(ReprotuneError, match=r"my_reward.py:0: objective.rewards\[0\]: defines no function 'nope'"):
        rw.load_rewards([f"{file}:nope"])


def test_make_plan_and_prepare_never_import_a_users_reward(tmp_path: Path) -> None:
    from reprotune.prepare import prepare
    from reprotune.sizing.report import make_plan

    marker, file = tmp_path / "imported", tmp_path / "mine.py"
    file.write_text(f"open({str(marker)!r}, 'w').write('yes')\ndef f(prompts, completions, **kw):\n    return [0.0]\n")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)])
    cfg = compose([f"paths.root={tmp_path}", *GRPO, f"data.prompts.path={tmp_path}/p.jsonl",
                   f"objective.rewards=[json_valid,{file}:f]"])
    assert make_plan(cfg)["model"] and not marker.exists()
    prepare(cfg)
    assert (tmp_path / "data/prompts/train.jsonl").is_file() and not marker.exists()


def _bad(file: Path, body: str) -> rw.RewardFunc:
    file.write_text(body)
    return rw.load_rewards([f"{file}:score"])[0][0]


def test_a_reward_that_raises_or_returns_a_non_number_is_one_line_naming_it(tmp_path: Path) -> None:
    prompts, completions = ["a", "b", "c"], ["x", "boom", "z"]
    raises = _bad(tmp_path / "r1.py", "def score(prompts, completions, **kw):\n"
                  "    return [1 / (c != 'boom') for c in completions]\n")
    with pytest.raises(ReprotuneError, match=r"^reward score: raised ZeroDivisionError: division by zero at step 0, "
                                             r"completion 1 \(prompt 'b'\)$"):
        raises(prompts=prompts, completions=completions)
    text = _bad(tmp_path / "r2.py", "def score(prompts, completions, **kw):\n    return [1.0, 'high', 0.0]\n")
    with pytest.raises(ReprotuneError, match=r"^reward score: completion 1 \(prompt 'b'\) at step 0: returned "
                                             r"'high', not a finite number$"):
        text(prompts=prompts, completions=completions)
    nan = _bad(tmp_path / "r3.py", "def score(prompts, completions, **kw):\n    return [1.0, 0.0, float('nan')]\n")
    with pytest.raises(ReprotuneError, match=r"completion 2 \(prompt 'c'\) at step 0: returned nan"):
        nan(prompts=prompts, completions=completions)
    short = _bad(tmp_path / "r4.py", "def score(prompts, completions, **kw):\n    return [1.0]\n")
    with pytest.raises(ReprotuneError, match=r"reward score: returned 1 values for 3 completions"):
        short(prompts=prompts, completions=completions)
    # None is TRL's "does not apply to this completion": passed on as it is
    none = _bad(tmp_path / "r5.py", "def score(prompts, completions, **kw):\n    return [1, None, 0]\n")
    assert none(prompts=prompts, completions=completions) == [1.0, None, 0.0]


# --------------------------------------------------------------------------------------------------- prompts
GRPO = ["model=tiny_random", "objective=grpo", "data.scrub=false"]


def prepare_prompts(root: Path, *overrides: str) -> tuple[list[dict], list[dict], dict]:
    from reprotune.prepare import prepare

    prepare(compose([f"paths.root={root}", *GRPO, *overrides]))
    out = root / "data/prompts"
    read = [[json.loads(x) for x in (out / f).read_text().splitlines()] for f in ("train.jsonl", "holdout.jsonl")]
    return read[0], read[1], json.loads((out / "manifest.json").read_text())


def test_sft_conversations_become_prompts_with_their_answers_split_as_sft_splits_them(tmp_path: Path) -> None:
    from reprotune.prepare import prepare

    small_invoices(tmp_path)
    raw = tmp_path / "data/raw/invoices.jsonl"
    conversations = [json.loads(x)["messages"] for x in raw.read_text().splitlines()]
    train, holdout, manifest = prepare_prompts(tmp_path, f"data.path={raw}", "data.holdout_fraction=0.25")
    assert len(train) + len(holdout) == 40 and holdout
    assert all(r["prompt"] == c[:-1] and r["answer"] == c[-1]["content"] for r, c in
               zip(train + holdout, [c for c in conversations if c[:-1] in [r["prompt"] for r in train]]
                   + [c for c in conversations if c[:-1] in [r["prompt"] for r in holdout]], strict=True))
    assert manifest["outputs"]["train"]["sha256"] == sha256_file(tmp_path / "data/prompts/train.jsonl")
    # the SFT prepare of the same file holds out the same conversations: the SFT adapter never saw a holdout prompt
    prepare(compose([f"paths.root={tmp_path}", "model=tiny_random", "data.scrub=false", f"data.path={raw}",
                     "data.holdout_fraction=0.25"]))
    sft_holdout = [json.loads(x)["messages"] for x in (tmp_path / "data/prepared/holdout.jsonl").read_text().splitlines()]
    assert [c[:-1] for c in sft_holdout] == [r["prompt"] for r in holdout]


def test_trl_prompt_only_formats_are_read_with_their_reference_columns(tmp_path: Path) -> None:
    standard = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(12)]
    write_jsonl(tmp_path / "std.jsonl", standard)
    train, holdout, _ = prepare_prompts(tmp_path, f"data.path={tmp_path}/std.jsonl", "++data.prompts.keys={question: prompt}",
                                        f"data.prompts.path={tmp_path}/std.jsonl")
    assert sorted(train + holdout, key=lambda r: int(r["answer"])) == \
        [{"prompt": r["question"], "answer": r["answer"]} for r in standard]
    conversational = [{"prompt": [{"role": "system", "content": "Be brief."}, user(f"{i}*2?")], "solution": 2 * i}
                      for i in range(12)]
    write_jsonl(tmp_path / "conv.jsonl", conversational)
    train, holdout, _ = prepare_prompts(tmp_path, f"data.prompts.path={tmp_path}/conv.jsonl")
    assert sorted(train + holdout, key=lambda r: r["solution"]) == conversational


def test_pii_is_replaced_alike_in_a_prompt_and_its_reference_answer(tmp_path: Path) -> None:
    email = "jane.roe@acme-mail.de"
    write_jsonl(tmp_path / "pii.jsonl", [{"prompt": [user(f"Who sent it? Email {email} the invoice.")],
                                          "answer": json.dumps({"contact": email})}])
    train, holdout, manifest = prepare_prompts(tmp_path, f"data.prompts.path={tmp_path}/pii.jsonl", "data.scrub=true",
                                               "data.pii.names=false", "data.holdout_fraction=0")
    row = (train + holdout)[0]
    prompt, answer = row["prompt"][0]["content"], json.loads(row["answer"])["contact"]
    assert email not in prompt + row["answer"]
    assert "@" in answer and prompt == f"Who sent it? Email {answer} the invoice."  # the same fake in both
    report = json.loads((tmp_path / "data/prompts/report.json").read_text())
    assert report["inputs"] == [{"file": "pii.jsonl", "format": "conversational", "records": 1}]
    assert json.loads((tmp_path / "data/prompts/metrics.json").read_text())["pii_replacements"] >= 2


def test_bad_prompt_records_are_file_line_field_errors_all_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"prompt": "fine", "answer": "1"}, {"question": "no prompt", "answer": "2"},
                      {"prompt": [user("q"), {"role": "assistant", "content": "a"}], "answer": "3"},
                      {"prompt": "x", "answer": {"nested": True}}, {"prompt": [{"role": "robot", "content": "?"}],
                                                                   "answer": "4"}])
    with pytest.raises(ReprotuneError) as err:
        prepare_prompts(tmp_path, f"data.prompts.path={bad}")
    assert err.value.problems == [
        f"{bad}:2: prompt: missing (TRL's prompt-only formats: {{\"prompt\": \"...\"}} or {{\"prompt\": [messages]}}; "
        "data.prompts.keys maps another name onto it)",
        f"{bad}:3: prompt[1]: the prompt ends with an assistant turn (a prompt-only record ends with the turn the "
        "model answers)",
        f"{bad}:4: answer: a reference column holds text or a number, not dict (JSON answers as a string)",
        f"{bad}:5: prompt[0]: a message needs a role (system, user, assistant, tool) and string content"]
    assert not (tmp_path / "data/prompts").exists()
    write_jsonl(bad, [{"prompt": "a", "answer": "1"}, {"prompt": [user("b")], "answer": "2"}])
    with pytest.raises(ReprotuneError, match=r"bad.jsonl:2: prompt: mixes conversational and standard records"):
        prepare_prompts(tmp_path, f"data.prompts.path={bad}")


def test_train_refuses_the_sft_data_for_grpo_in_one_line(tmp_path: Path) -> None:
    from reprotune.train import train

    small_invoices(tmp_path)
    (tmp_path / "data/prompts").mkdir(parents=True)
    (tmp_path / "data/prompts/train.jsonl").write_text((tmp_path / "data/prepared/train.jsonl").read_text())
    with pytest.raises(ReprotuneError, match=r"prompts/train.jsonl:1: prompt: holds SFT conversations; prepare"):
        train(compose([f"paths.root={tmp_path}", *GRPO, "objective.init_adapter=null"]))


# ----------------------------------------------------------------------------------------------------- train
# a reward whose value differs between completions of a random model (digits are rare in its samples, spaces
# common): the group's advantages are not all zero, so the adapter moves
DIGITS = "def spaces(prompts, completions, **kw):\n" \
         "    return [sum(ch == ' ' for ch in c[0]['content']) / 10 for c in completions]\n"
GRPO_TRAIN = [*GRPO, "objective.init_adapter=null", "++objective.max_steps=3", "objective.num_generations=2",
              "objective.max_completion_length=12", "objective.learning_rate=0.05", "train.per_device_train_batch_size=4",
              "train.warmup_steps=0", "train.logging_steps=1", "train.save_steps=100"]


def grpo_workspace(root: Path) -> Path:
    """small_invoices, their prompts in data/prompts as prepare writes them, and the user's reward spaces.py."""
    small_invoices(root)
    for split in ("train", "holdout"):
        write_jsonl(root / f"data/prompts/{split}.jsonl",
                    [{"prompt": json.loads(x)["messages"][:-1], "answer": json.loads(x)["messages"][-1]["content"]}
                     for x in (root / f"data/prepared/{split}.jsonl").read_text().splitlines()])
    reward = root / "spaces.py"
    reward.write_text(DIGITS)
    return reward


def test_grpo_reruns_give_the_same_adapter_and_rollouts_and_record_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from reprotune.train import train

    records = []
    for name in ("one", "two"):
        reward = grpo_workspace(tmp_path / name)
        records.append(train(compose([f"paths.root={tmp_path / name}", *GRPO_TRAIN,
                                      f"objective.rewards=[json_valid,{reward}:spaces]"])))
    one, two = records
    assert one["outputs"]["adapter"]["sha256"] == two["outputs"]["adapter"]["sha256"]
    assert one["objective"]["rollouts"]["sha256"] == two["objective"]["rollouts"]["sha256"]
    out = tmp_path / "one/outputs/rl"
    assert one["objective"]["rollouts"] == {"path": "outputs/rl/rollouts.jsonl", "sha256": sha256_file(out / "rollouts.jsonl")}
    # every generation batch kept: 3 steps x 4 completions (2 prompts x 2), each with both rewards
    rows = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["index"]) for r in rows] == [(s, i) for s in range(3) for i in range(4)]
    assert all(set(r["rewards"]) == {"json_valid", "spaces"} and r["completion"][0]["role"] == "assistant"
               for r in rows)
    assert rows[0]["prompt"] == rows[1]["prompt"] != rows[2]["prompt"]  # a group: one prompt, two samples
    assert len({r["rewards"]["spaces"] for r in rows}) > 1
    # the rewards moved the fresh adapter (LoRA's B starts at zero)
    weights = load_file(str(out / "adapter/adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k)
    rewards = one["objective"]["rewards"]
    assert rewards[0] == {"name": "json_valid", "label": "json_valid", "params": {}}
    assert rewards[1]["file"]["sha256"] == sha256_file(tmp_path / "one/spaces.py")
    assert one["objective"]["sampling"]["num_generations"] == 2
    assert one["objective"]["sampling"]["max_completion_length"] == 12
    assert one["objective"]["init_adapter"] is None
    metrics = json.loads((out / "train/metrics.json").read_text())
    assert metrics["global_step"] == 3 and "rewards/spaces_mean" in metrics
    assert not (tmp_path / "one/outputs/adapter").exists()


def test_grpo_starts_from_the_init_adapter_recorded_by_sha256_and_eval_compares_the_three(tmp_path: Path) -> None:
    from reprotune.train import train

    grpo_workspace(tmp_path)
    base = [f"paths.root={tmp_path}", "model=tiny_random", "data.scrub=false", "train.max_steps=1",
            "train.save_steps=100"]
    train(compose(base))  # the SFT adapter: objective.init_adapter's default
    record = train(compose([*base, *GRPO_TRAIN[4:], "objective=grpo", "++objective.max_steps=1",
                            "objective.rewards=[json_valid]"]))
    sft = tmp_path / "outputs/adapter"
    assert record["objective"]["init_adapter"]["path"] == "outputs/adapter"
    assert record["objective"]["init_adapter"]["sha256"] == json.loads(
        (tmp_path / "outputs/train/manifest.json").read_text())["outputs"]["adapter"]["sha256"]
    assert (sft / "adapter_model.safetensors").is_file() and (tmp_path / "outputs/rl/adapter").is_dir()
    # make eval of the RL run: the holdout prompts' answers through base, the SFT adapter and the RL adapter
    from reprotune.evaluate import evaluate

    out = evaluate(compose([*base, "objective=grpo", "eval.max_examples=2", "eval.max_new_tokens=4"]))
    assert {"base", "sft", "tuned"} <= set(out["metrics"]) and out["metrics"]["examples"] == 2
    assert "field_accuracy" in out["metrics"]["tuned"]
    assert out["manifest"]["inputs"]["adapter"]["path"] == "outputs/rl/adapter"
    assert out["manifest"]["inputs"]["holdout"]["path"] == "data/prompts/holdout.jsonl"
    assert (tmp_path / "outputs/rl/eval/report.md").is_file() and not (tmp_path / "outputs/eval").exists()


def test_grpo_trains_a_dora_adapter(tmp_path: Path) -> None:
    from reprotune.train import train

    grpo_workspace(tmp_path)
    record = train(compose([f"paths.root={tmp_path}", *GRPO_TRAIN, "method=dora", "++objective.max_steps=1",
                            "objective.rewards=[json_valid]"]))
    config = json.loads((tmp_path / "outputs/rl/adapter/adapter_config.json").read_text())
    assert config["use_dora"] is True and record["objective"]["name"] == "grpo"


def test_a_bad_reward_stops_the_train_stage_in_one_line_with_a_non_zero_exit(tmp_path: Path) -> None:
    grpo_workspace(tmp_path)
    (tmp_path / "bad.py").write_text("def score(prompts, completions, **kw):\n"
                                     "    return ['x' if i == 1 else 0.0 for i, _ in enumerate(completions)]\n")
    done = subprocess.run([sys.executable, "-m", "reprotune.train", f"paths.root={tmp_path}", *GRPO_TRAIN,
                           f"objective.rewards=[json_valid,{tmp_path}/bad.py:score]"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    # the line names the function, the completion's index, its prompt (the turn answered) and the value
    lines = re.findall(r"reward score: .*", done.stderr)
    assert len(lines) == 1 and re.fullmatch(r"reward score: completion 1 \(prompt '[^']+'\) at step 0: "
                                            r"returned 'x', not a finite number", lines[0]), lines
    assert "Extract the invoice fields" not in lines[0]  # the user's turn, not the system prompt
    assert "Traceback" not in done.stderr


def test_make_refuses_grpo_until_it_has_a_dvc_chain_in_one_line(tmp_path: Path) -> None:
    """The SFT chain's stages would otherwise run objective=grpo over the SFT chain's outputs."""
    from reprotune.config import check_chain
    from reprotune.runner import refuse_without_chain

    refuse_without_chain("train", ["objective=dpo"])  # the preference chain's: not refused here
    with pytest.raises(ReprotuneError, match=r"^make train: objective=grpo has no DVC chain yet \(docs/grpo.md\); run "
                                             r"its stages directly: .*; nothing was changed$"):
        refuse_without_chain("train", ["objective=grpo"])
    for params in ("params", "params_pref"):
        with pytest.raises(ReprotuneError, match=rf"^{params}.yaml:\d+: objective.name: 'grpo' has no DVC chain yet"):
            check_chain(compose(["objective=grpo"]), params)


@pytest.mark.slow  # three training processes (~25 s), one killed mid-run
def test_grpo_kill_9_then_rerun_gives_the_uninterrupted_adapter_and_rollouts(tmp_path: Path) -> None:
    """The SFT resume machinery (reprotune.checkpoints) under GRPO: the sampling resumes where the checkpoint left
    it (TRL restores the RNG states), and the rollouts file keeps the killed run's rows before its checkpoint."""

    from .test_resume import killed_at_step_then_rerun

    def cmd(root: Path) -> list[str]:
        return [sys.executable, "-m", "reprotune.train", *GRPO_TRAIN, "++objective.max_steps=6", "train.save_steps=2",
                f"objective.rewards=[json_valid,{root}/spaces.py:spaces]", f"paths.root={root}"]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for root in (straight, killed):
        grpo_workspace(root)
    resumed, whole = killed_at_step_then_rerun(cmd, straight, killed, "outputs/rl")
    assert resumed["outputs"]["adapter"]["sha256"] == whole["outputs"]["adapter"]["sha256"]
    assert resumed["objective"]["rollouts"]["sha256"] == whole["objective"]["rollouts"]["sha256"]
    steps = [json.loads(x)["step"] for x in (killed / "outputs/rl/rollouts.jsonl").read_text().splitlines()]
    assert steps == [s for s in range(6) for _ in range(4)]
