"""The eval holdout: its examples read and checked (a bad line named by file, line and field), messages and
preference rows alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reprotune import metrics as mx
from reprotune.errors import ReprotuneError
from reprotune.io import iter_jsonl
from reprotune.preference import pair_eval


@dataclass
class Example:
    index: int                      # line order in the holdout file
    prompt: list[dict[str, str]] | str  # every message but the last (assistant) one; a text preference row's prompt
    reference: str                  # the last assistant message
    row: int | None = None          # a preference holdout: the row it comes from (KTO: only label-true rows)
    where: str = ""                 # file:line: field of the reference, for a message about it


def read_holdout(path: Path, max_examples: int | None = None) -> list[Example]:
    """Validate while reading: a bad line is reported by file, line number and field. A preference holdout's
    rows are examples too: a pair's chosen answer, a KTO row's completion when its label is true, is the reference
    (a label-false row has none); text (standard) rows keep their text prompt; max_examples counts rows."""
    examples: list[Example] = []
    rows = 0
    for lineno, row in iter_jsonl(path, "run 'make prepare' first"):
        where = f"{path}:{lineno}"
        rows += 1
        messages = row.get("messages") if isinstance(row, dict) else None
        kind = pair_eval.row_kind(row) if messages is None else None
        text = bool(kind) and isinstance(row["prompt"], str)
        if examples and text != isinstance(examples[-1].prompt, str):
            raise ReprotuneError(f"{where}: prompt: mixes text (standard) rows and message rows; one holdout holds "
                                 "one kind")
        if text:  # trained on raw text: asked the same way
            if kind == "pairs" or row["label"]:
                answer = "chosen" if kind == "pairs" else "completion"
                examples.append(Example(len(examples), row["prompt"], row[answer], rows - 1, f"{where}: {answer}"))
            if max_examples and rows >= max_examples:
                break
            continue
        if kind == "pairs":
            messages = [*row["prompt"], *row["chosen"]]  # a preference pair: the chosen answer is the reference
        elif kind == "kto" and not row["label"]:
            if max_examples and rows >= max_examples:
                break
            continue  # an undesirable completion is no reference
        elif kind == "kto":
            messages = [*row["prompt"], *row["completion"]]
        if not isinstance(messages, list) or len(messages) < 2:
            raise ReprotuneError(f"{where}: messages: must be a list of at least 2 messages")
        for i, msg in enumerate(messages):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                    and isinstance(msg.get("content"), str)):
                raise ReprotuneError(f"{where}: messages[{i}]: needs string 'role' and 'content'")
        if messages[-1]["role"] != "assistant":
            raise ReprotuneError(f"{where}: messages[-1].role: must be 'assistant' (the reference)")
        field = {"pairs": "chosen[-1].content", "kto": "completion[-1].content"}.get(kind, "messages[-1].content")
        examples.append(Example(len(examples), messages[:-1], messages[-1]["content"], rows - 1 if kind else None,
                                f"{where}: {field}"))
        if max_examples and rows >= max_examples:
            break
    if not examples:
        raise ReprotuneError(f"{path}:1: file: holds no examples")
    return examples


def read_prompt_holdout(path: Path, max_examples: int | None = None, column: str = "answer") -> list[Example]:
    """An RL run's prepared prompts (reprotune.rl.prompts) as examples: the prompt (messages, or a standard row's
    text, asked as it is) and its reference answer `column` (the SFT conversations' last answer); rows without
    one are skipped, and max_examples counts rows."""
    examples: list[Example] = []
    for rows, (lineno, row) in enumerate(iter_jsonl(path, "run 'make prepare ARGS=\"objective=grpo\"' first"), 1):
        if not isinstance(row, dict) or "prompt" not in row:
            raise ReprotuneError(f"{path}:{lineno}: prompt: not a prompt row (make prepare ARGS=\"objective=grpo\")")
        if isinstance(row.get(column), str):
            examples.append(Example(len(examples), row["prompt"], row[column], None, f"{path}:{lineno}: {column}"))
        if max_examples and rows >= max_examples:
            break
    if not examples:
        raise ReprotuneError(f"{path}:1: {column}: no prompt has a reference answer to score (the eval of an RL run "
                             f"scores the prompts' '{column}' column)")
    return examples


def check_references(examples: Sequence[Example], task: dict) -> None:
    """A json task's references must be JSON objects, or every score would be meaningless."""
    if task["type"] != "json":
        return
    for ex in examples:
        if mx.parse_json_object(ex.reference) is None:
            raise ReprotuneError(f"{ex.where}: the reference answer is not a JSON object, but data.task.type is json; "
                                 "for free-text answers set data.task.type=text (or auto: inferred from the answers)")
