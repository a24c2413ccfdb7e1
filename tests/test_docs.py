"""The docs claim what the project holds: README.md stays a user's page (at most 120 lines), every relative link in
README.md and docs/ reaches a file, dated measurement records live in docs/measurements/ (one file per dated run,
YYYY-MM-DD-topic.md) and each is linked from a page, no page speaks of the sessions that wrote it, and the list of
GPU test modules in docs/gpu.md is the one the `gpu` marker selects."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
SESSION = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)|this|"
                     r"that|previous|last|next|earlier|filing)[ -]sessions?\b", re.IGNORECASE)


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(page.read_text())]


def test_the_readme_is_at_most_120_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


def test_every_relative_link_reaches_a_file() -> None:
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"^[a-z]+:", link) or link.startswith("#"):
                continue
            target = (page.parent / link.split("#")[0]).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, broken


def test_measurement_records_are_dated_files_each_linked_from_a_page() -> None:
    records = sorted((ROOT / "docs" / "measurements").glob("*"))
    assert records
    linked = {(page.parent / link.split("#")[0]).resolve() for page in PAGES
              if page.parent.name != "measurements" for link in _links(page)}
    for record in records:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+\.md", record.name), record.name
        assert record.resolve() in linked, f"{record.name} is linked from no reference page"


def test_no_page_speaks_of_the_session_that_wrote_it() -> None:
    found = []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if SESSION.search(line):
                found.append(f"{rel}:{n}: {SESSION.search(line).group(0)}")
    assert not found, found


def test_the_gpu_test_list_is_what_the_gpu_marker_selects() -> None:
    marked = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text()
                    and p.name != Path(__file__).name)
    section = (ROOT / "docs" / "gpu.md").read_text().split("## Tests on a GPU machine")[1].split("\n## ")[0]
    listed = sorted(re.findall(r"^- `tests/(test_\w+\.py)`", section, re.MULTILINE))
    assert listed == marked
    skips_without_cuda = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                                if re.search(r"skipif\(\s*not \(?torch\.cuda\.is_available\(\)", p.read_text()))
    assert set(skips_without_cuda) <= set(marked), "a module that needs CUDA lacks the gpu marker"
