"""A user's own data end to end, as a new user runs it (#50 item 7): in a fresh git copy of this checkout, the
settings given once (`make init DATA=<file outside the repo> ARGS=<tiny settings>`), then plain `make train`,
`make eval`, `make gguf`, `make serve` and one `openai` client request without a system message. Asserted: the
task inferred from the data (text metrics, no invoice ones), the data's name in the report and the served model
id, the served answer equal to the exported model's greedy answer with the training system prompt (make serve
applied it), no DVC git hints, and that data/prepared/ and outputs/adapter/ were never replaced by the built-in
task's, also not by a target run with other settings (refused in one line)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from reprotune.manifest import sha256_tree

from .test_make_pipeline import VENV, clone, run  # noqa: F401 (clone: the fresh-copy fixture)

pytestmark = pytest.mark.slow

SYSTEM = "Convert the date to ISO 8601. Answer with the date only."
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
# the tiny model as test_make_pipeline runs it; eval.max_new_tokens and data.task are left to infer
TINY = ["model=tiny_random", "train.max_steps=3", "train.save_steps=3", "train.logging_steps=1",
        "train.per_device_train_batch_size=2", "train.learning_rate=0.01", "eval.max_examples=2",
        "export.merge.prompts=2", "export.parity.examples=2", "export.parity.max_new_tokens=16"]


def dates(n: int) -> list[dict]:
    return [{"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"{i % 28 + 1} {MONTHS[i % 12]} {2000 + i}"},
                          {"role": "assistant", "content": f"{2000 + i}-{i % 12 + 1:02d}-{i % 28 + 1:02d}"}]}
            for i in range(n)]


def make(root: Path, env: dict, target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", target, *args], cwd=root, env=env, capture_output=True, text=True, timeout=1800)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{proc.args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def outputs(root: Path) -> dict[str, str]:
    return {**{f"prepared/{k}": v for k, v in sha256_tree(root / "data/prepared").items()},
            **{f"adapter/{k}": v for k, v in sha256_tree(root / "outputs/adapter").items()}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_users_data_from_file_to_served_answer(clone: tuple[Path, dict]) -> None:  # noqa: F811
    root, env = clone
    data = root.parent / "Dates 2025.jsonl"  # outside the repository, a name with a space and a capital
    data.write_text("".join(json.dumps(r) + "\n" for r in dates(40)))
    started = time.time()
    init = ok(make(root, env, "init", f"DATA={data}", f"ARGS={' '.join(TINY)}"))
    assert "wrote conf/project/current.yaml" in init and "name: dates-2025" in init

    train = ok(make(root, env, "train"))
    assert "Running stage 'prepare'" in train and "Running stage 'train'" in train
    # DVC's git hints and the empty rejected.jsonl warning are left out; the stages' own lines are not
    assert "git add" not in train and "autostage" not in train and "dvc push" not in train
    assert "rejected.jsonl' is empty" not in train
    built = outputs(root)
    prepared = [json.loads(x) for x in (root / "data/prepared/train.jsonl").read_text().splitlines()]
    assert prepared and all(r["messages"][0]["content"] == SYSTEM for r in prepared)

    evaluated = ok(make(root, env, "eval"))
    assert "Running stage 'eval'" in evaluated and "Running stage 'train'" not in evaluated
    metrics = json.loads((root / "outputs/eval/metrics.json").read_text())
    assert set(metrics["tuned"]) == {"exact_match", "token_f1", "rougeL", "loss", "perplexity"}  # text, no invoice
    report = (root / "outputs/eval/report.md").read_text()
    assert report.startswith("# Evaluation: tiny_random base vs + adapter on the dates-2025 holdout")
    assert "Task type `text`" in report

    # a target run with other settings (the built-in data) is refused in one line, before any work
    other = make(root, env, "eval", "ARGS=data.path=data/raw/invoices.jsonl")
    assert other.returncode == 2
    assert other.stderr.splitlines()[0].startswith("make eval: data/prepared/train.jsonl was built by another run "
                                                   f"(data.name=dates-2025 data.path={data}"), other.stderr
    assert "nothing was changed" in other.stderr and "Running stage" not in other.stdout + other.stderr

    exported = ok(make(root, env, "gguf"))
    assert "Running stage 'merge'" in exported and "Running stage 'gguf'" in exported
    assert "Running stage 'train'" not in exported and "Running stage 'prepare'" not in exported
    assert outputs(root) == built  # never replaced by the built-in task's, nor rebuilt at all
    modelfile = (root / "outputs/gguf/Modelfile").read_text()
    assert f'SYSTEM """{SYSTEM}"""' in modelfile
    info = ok(make(root, env, "serve-info"))
    assert "model 'reprotune-dates-2025'" in info and f"started with {SYSTEM!r}" in info
    took = time.time() - started

    port = free_port()
    log = root / "serve.log"
    with open(log, "wb") as fh:
        # the tiny random model's 4-bit quant need not pass the parity gate (make serve's refusal of a failed quant
        # is tests/test_export_gate.py's): served as a user who read that refusal would
        server = subprocess.Popen(["make", "serve", f"ARGS=export.serve.port={port} export.serve.allow_failed=true"],
                                  cwd=root, env=env, stdout=fh,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        from openai import OpenAI

        parity = json.loads((root / "outputs/gguf/parity.json").read_text())
        holdout = [json.loads(x) for x in (root / "data/prepared/holdout.jsonl").read_text().splitlines()]
        question = holdout[0]["messages"][1]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local")
        reply = client.chat.completions.create(
            model="reprotune-dates-2025", messages=[question], temperature=0.0,
            max_tokens=parity["max_new_tokens"], extra_body={"top_k": 1, "repeat_penalty": 1.0, "min_p": 0.0,
                                                            "top_p": 1.0})
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    assert reply.model == "reprotune-dates-2025"
    # the exported model's greedy answer to the holdout conversation with its system prompt: the server added it
    # make serve served the quant make gguf chose (parity.json serve_quant), and answered as its parity run did
    assert reply.choices[0].message.content == parity["gguf_outputs"][parity["serve_quant"]][0]
    assert outputs(root) == built
    print(f"\nuser data, tiny model: make init + train + eval + (refused eval) + gguf + serve-info {took:.0f}s")
