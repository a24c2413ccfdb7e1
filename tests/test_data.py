"""The built-in dataset: deterministic, varied, and exactly the bytes data.dvc records."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from reprotune.invoices import FIELDS, generate, write_jsonl


def test_generator_is_deterministic(tmp_path: Path) -> None:
    write_jsonl(generate(50, 3), tmp_path / "a.jsonl")
    write_jsonl(generate(50, 3), tmp_path / "b.jsonl")
    write_jsonl(generate(50, 4), tmp_path / "c.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


def test_examples_are_varied_and_well_formed() -> None:
    rows = generate(600, 1234)
    currencies, suppliers, date_styles = set(), set(), set()
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant"]
        answer = json.loads(row["messages"][2]["content"])
        assert tuple(answer) == FIELDS
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", answer["date"])
        currencies.add(answer["currency"])
        suppliers.add(answer["supplier"])
        user = row["messages"][1]["content"]
        for style, pattern in {"iso": r"\d{4}-\d{2}-\d{2}", "slash": r"\d{2}/\d{2}/\d{4}", "dot": r"\d{2}\.\d{2}\.\d{4}",
                               "long": r"\d{1,2} [A-Z][a-z]+ \d{4}", "us": r"[A-Z][a-z]{2} \d{1,2}, \d{4}",
                               "dash": r"\d{2}-[A-Z][a-z]{2}-\d{4}"}.items():
            if re.search(pattern, user):
                date_styles.add(style)
    assert len(currencies) >= 6 and len(suppliers) >= 20 and len(date_styles) == 6
    texts = " ".join(r["messages"][1]["content"] for r in rows)
    assert re.search(r"\d{1,3}(,\d{3})+\.\d{2}", texts)  # 1,234.56
    assert re.search(r"\d{1,3}(\.\d{3})+,\d{2}", texts)  # 1.234,56


def test_raw_data_matches_data_dvc() -> None:
    """What 'make data' produced (pulled or regenerated) is exactly what data.dvc records."""
    out = subprocess.run([".venv/bin/dvc", "status", "data.dvc"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stdout, out.stdout
    regenerated = generate(600, 1234)
    on_disk = [json.loads(line) for line in Path("data/raw/invoices.jsonl").read_text().splitlines()]
    assert on_disk == regenerated
