"""Files: JSONL reading with one error style, atomic writes (temp path, then rename), directory swaps, the
content hash that places an example in a split, and a spool of examples on disk read back by index.

Nothing a stage writes is ever half there: files are written next to their destination and renamed over it;
directories are built as `<name>.tmp` and swapped in, so a crash leaves the previous output (or none).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from array import array
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError


# ------------------------------------------------------------------------------------------------- JSONL
def iter_jsonl(path: Path, missing_hint: str = "") -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; a missing file or bad JSON is a ReprotuneError."""
    if not path.is_file():
        raise ReprotuneError(f"{path}: file: not found" + (f"; {missing_hint}" if missing_hint else ""))
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise ReprotuneError(f"{path}:{lineno}: json: not valid JSON ({err.msg})") from None
            except RecursionError:
                raise ReprotuneError(f"{path}:{lineno}: json: nested too deeply to parse") from None


def read_examples(path: Path, missing_hint: str = "") -> list[dict[str, Any]]:
    """Every line of a prepared JSONL file (an object with a `messages` list, maybe `tools`), in file order;
    at least one."""
    rows = []
    for lineno, row in iter_jsonl(path, missing_hint):
        if isinstance(row, dict) and "messages" not in row and ("chosen" in row or "label" in row):
            raise ReprotuneError(f"{path}:{lineno}: messages: holds preference data (prompt, chosen, rejected); "
                                 "train it with objective=dpo, orpo or kto, or prepare SFT data")
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise ReprotuneError(f"{path}:{lineno}: messages: expected a list of messages")
        rows.append(row)
    if not rows:
        raise ReprotuneError(f"{path}:1: file: holds no examples")
    return rows


def read_conversations(path: Path, missing_hint: str = "") -> list[list[dict[str, Any]]]:
    """The `messages` list of every line of a prepared JSONL file, in file order; at least one."""
    return [row["messages"] for row in read_examples(path, missing_hint)]


def jsonl_text(rows: list[Any], sort_keys: bool = False) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=sort_keys) + "\n" for r in rows)


# ------------------------------------------------------------------------------------------- UTF-8 text
BOM = b"\xef\xbb\xbf"


def scan_utf8(path: Path, problem: Callable[..., None]) -> tuple[bool, str]:
    """(the file is UTF-8, its sha256), read line by line: invalid bytes are reported by line (a leading BOM
    tolerated) through `problem(line, field, what, record=False)`, and the file is never held whole."""
    digest, valid = hashlib.sha256(), True
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            digest.update(raw)
            line = raw[3:] if number == 1 and raw.startswith(BOM) else raw
            line = line.removesuffix(b"\n")
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                valid = False
                problem(number, "encoding", f"invalid UTF-8 (byte 0x{line[err.start]:02x} at column "
                                           f"{err.start + 1}); save the file as UTF-8", record=False)
    return valid, digest.hexdigest()


def text_lines(path: Path) -> Iterator[str]:
    """A UTF-8 file's text line by line (a leading BOM dropped; CRLF and a lone CR end a line, as LF does),
    one line in memory at a time: a file of a million records is never held whole (#22)."""
    ended = True  # the text so far ends a line: what follows (maybe nothing) is one more, as str.split gives
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            text = (raw[3:] if number == 1 and raw.startswith(BOM) else raw).decode("utf-8")
            ended = text.endswith("\n")
            if ended:
                text = text[:-1].removesuffix("\r")  # CRLF is one line end
            yield from text.split("\r")
    if ended:
        yield ""


def text_lf(path: Path) -> str:
    """A UTF-8 file's whole text with LF line ends (a JSON array is parsed as one document)."""
    return "\n".join(text_lines(path))



# --------------------------------------------------------------------------------------------- atomic files
def tmp_path(path: Path, suffix: str = ".tmp") -> Path:
    return path.with_name(path.name + suffix)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def save_figure(fig: Any, out: Path) -> None:
    """A matplotlib figure as PNG without a version stamp (same plot, same bytes), written atomically."""
    tmp = tmp_path(out, ".tmp.png")  # savefig picks the format from the suffix
    fig.savefig(tmp, metadata={"Software": None})
    os.replace(tmp, out)


def replace_all(files: dict[Path, bytes | Path]) -> None:
    """Stage every output next to its destination, then rename them all: a failure before the renames leaves
    the previous outputs untouched."""
    staged = []
    for dest, content in files.items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_path(dest)
        if isinstance(content, Path):
            os.replace(content, tmp)
        else:
            tmp.write_bytes(content)
        staged.append((tmp, dest))
    for tmp, dest in staged:
        os.replace(tmp, dest)


# ---------------------------------------------------------------------------------------------- directories
def fresh_dir(final: Path, suffix: str = ".tmp") -> Path:
    """An empty `<final><suffix>` directory to build an output in (a leftover from a crash is removed)."""
    tmp = tmp_path(final, suffix)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_dir(tmp: Path, final: Path) -> None:
    """Swap a finished directory in for the previous one: a crash never leaves a half-written output."""
    old = tmp_path(final, ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def install_dir_once(tmp: Path, final: Path) -> None:
    """Move a finished cache entry into place unless a concurrent process already did (its copy is identical
    by construction)."""
    if final.exists():
        shutil.rmtree(tmp)
        return
    os.replace(tmp, final)


# ------------------------------------------------------------------------------------------------- splits
def content_key(content: Any, ensure_ascii: bool = False) -> str:
    """sha256 of an example's content (its messages, and tools where it has them): its identity for dedup and
    for which split it lands in."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=ensure_ascii).encode()).hexdigest()


def unique_by_content(records: list[Any]) -> list[Any]:
    """The first of each set of records whose `.row` has the same content_key, in order (the prompt and pair
    chains' dedup)."""
    seen: set[str] = set()
    out = []
    for r in records:
        key = content_key(r.row)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def key_fraction(key: str) -> float:
    """A content key as a number in [0, 1]: `< fraction` puts an example in a split by its content alone,
    never by its neighbours or a shuffle, so appending data never moves an existing example."""
    return int(key[:8], 16) / 0xFFFFFFFF


# -------------------------------------------------------------------------------------------------- spool
class Spool:
    """Examples as JSON lines in a file, appended in order and read back by index: a million examples cost
    8 bytes each in memory (their offsets) instead of ~0.8 kB of message dicts. Reads go through pread, not
    mmap, so the file's pages are the kernel's cache, never this process's resident memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "w+b")  # noqa: SIM115 - closed by close()
        self._offsets = array("q", [0])
        self._dirty = False

    def append(self, line: bytes) -> int:
        """Store one line (ending in a newline); its index."""
        self._file.write(line)
        self._offsets.append(self._offsets[-1] + len(line))
        self._dirty = True
        return len(self._offsets) - 2

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _flushed(self) -> int:
        if self._dirty:
            self._file.flush()
            self._dirty = False
        return self._file.fileno()

    def line(self, index: int) -> bytes:
        start = self._offsets[index]
        return os.pread(self._flushed(), self._offsets[index + 1] - start, start)

    def row(self, index: int) -> Any:
        return json.loads(self.line(index))

    def lines(self) -> Iterator[bytes]:
        """Every line in order, read sequentially."""
        self._flushed()
        with open(self.path, "rb") as fh:
            for start, end in pairwise(self._offsets):
                yield fh.read(end - start)

    def close(self) -> Path:
        self._file.close()
        return self.path
