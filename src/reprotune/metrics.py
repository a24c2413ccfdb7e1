"""Scoring one prediction against its reference, as the task config asks (used by reprotune.evaluate).

Every metric is a per-example score in [0, 1]; a system's score is the mean over the holdout.

- json tasks (data.task.type=json): json_valid, exact_match (whole object), field_accuracy (mean over the
  declared fields) and field/<name>, schema_ok (exactly the declared keys, each of its declared type).
- text tasks (data.task.type=text): exact_match, token_f1 (SQuAD-style bag of words), rougeL (F-measure,
  Google's rouge-score package).
- any task: extra metrics declared in data.task.metrics, without code:
      - {name: total_ok, kind: json_field, field: total}             # one field (or `fields: [...]`, all of them)
      - {name: exact_ci, kind: exact, normalize: lower}              # whole reply; normalize: strip|lower|none
      - {name: iso_date, kind: regex, pattern: '\\d{4}-\\d{2}-\\d{2}'} # the reply matches (mode: match)
      - {name: answer, kind: regex, pattern: '#### (\\S+)', mode: extract}  # group 1 equals the reference's
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from reprotune.errors import ReprotuneError
from reprotune.schema import TASK_TYPES

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}
# markdown code fences around a JSON answer are formatting, not content: chat models add them unprompted
FENCE_RE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)
CUSTOM_KINDS = ("json_field", "exact", "regex")


# --------------------------------------------------------------------------------------------- json tasks
def parse_json_object(text: str) -> dict | None:
    """The reply as a JSON object (a surrounding ``` fence is allowed), or None if it is not one."""
    text = text.strip()
    fenced = FENCE_RE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _type_ok(value: Any, type_name: str) -> bool:
    if type_name == "any":
        return True
    if isinstance(value, bool) and type_name in ("number", "integer"):
        return False  # JSON true is not a number, although Python's bool is an int
    return isinstance(value, JSON_TYPES[type_name])


def _same_value(pred: Any, ref: Any) -> bool:
    """Equal as JSON values: 12 == 12.0, but true != 1 and "12" != 12."""
    if isinstance(pred, bool) or isinstance(ref, bool):
        return type(pred) is type(ref) and pred == ref
    return pred == ref


def json_scores(prediction: str, reference: str, fields: Sequence[str],
                field_types: Mapping[str, str] | None = None) -> dict[str, float]:
    ref = parse_json_object(reference)
    if ref is None:
        raise ReprotuneError(f"reference is not a JSON object: {reference[:80]!r}")
    pred = parse_json_object(prediction)
    fields = list(fields) or sorted(ref)
    types = dict(field_types or {})
    scores: dict[str, float] = {"json_valid": float(pred is not None)}
    pred = pred or {}
    per_field = {f: float(f in pred and f in ref and _same_value(pred[f], ref[f])) for f in fields}
    scores["exact_match"] = float(bool(pred) and set(pred) == set(ref)
                                  and all(_same_value(pred[k], ref[k]) for k in ref))
    scores["field_accuracy"] = sum(per_field.values()) / len(per_field)
    scores["schema_ok"] = float(bool(pred) and set(pred) == set(fields)
                                and all(_type_ok(pred[f], types.get(f, "any")) for f in fields))
    scores.update({f"field/{f}": v for f, v in per_field.items()})
    return scores


# --------------------------------------------------------------------------------------------- text tasks
def _normalize_words(text: str) -> list[str]:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = _normalize_words(prediction), _normalize_words(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@cache
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    return float(_rouge_scorer().score(reference, prediction)["rougeL"].fmeasure)


def text_scores(prediction: str, reference: str) -> dict[str, float]:
    return {"exact_match": float(prediction.strip() == reference.strip()),
            "token_f1": token_f1(prediction, reference),
            "rougeL": rouge_l(prediction, reference)}


# ------------------------------------------------------------------------------ metrics declared in config
def _normalize(text: str, how: str) -> str:
    if how == "none":
        return text
    if how == "strip":
        return text.strip()
    if how == "lower":
        return " ".join(text.lower().split())
    raise ReprotuneError(f"exact metric: normalize must be strip|lower|none, not {how!r}")


def _regex_value(pattern: re.Pattern, text: str) -> str | None:
    found = pattern.search(text)
    if not found:
        return None
    return found.group(1) if pattern.groups else found.group(0)


def custom_score(spec: Mapping[str, Any], prediction: str, reference: str) -> float:
    kind = spec["kind"]
    if kind == "exact":
        how = spec.get("normalize", "strip")
        return float(_normalize(prediction, how) == _normalize(reference, how))
    if kind == "regex":
        pattern = re.compile(spec["pattern"])
        if spec.get("mode", "match") == "match":
            return float(pattern.search(prediction) is not None)
        ref_value = _regex_value(pattern, reference)
        return float(ref_value is not None and _regex_value(pattern, prediction) == ref_value)
    if kind == "json_field":
        wanted = [spec["field"]] if "field" in spec else list(spec["fields"])
        pred, ref = parse_json_object(prediction) or {}, parse_json_object(reference) or {}
        return float(all(f in pred and f in ref and _same_value(pred[f], ref[f]) for f in wanted))
    raise ReprotuneError(f"unknown metric kind {kind!r} (one of {', '.join(CUSTOM_KINDS)})")


# what describes the built-in invoice data only (conf/data/invoices.yaml): left out for a user's data unless set
BUILTIN_ONLY = ("fields", "field_types", "metrics", "primary_metric")


def resolve_task(task: Mapping[str, Any], references: Sequence[str], builtin: bool,
                 builtin_task: Mapping[str, Any]) -> dict[str, Any]:
    """data.task as evaluate scores it. type auto: json when every reference answer is a JSON object, else text.
    For a user's data (builtin False) the invoice task's own fields, metrics and primary metric (values equal to
    builtin_task's) are dropped, and a json task's fields are the references' keys; a value set explicitly wins."""
    if task.get("type") not in TASK_TYPES:
        raise ReprotuneError(f"data.task.type: {task.get('type')!r} is not one of {', '.join(TASK_TYPES)} (auto: json "
                             "when every reference answer is a JSON object, else text)")
    resolved = dict(task)
    if resolved["type"] == "auto":
        objects = [parse_json_object(r) for r in references]
        resolved["type"] = "json" if references and all(o is not None for o in objects) else "text"
    if builtin:
        return resolved
    for key in BUILTIN_ONLY:
        if key in resolved and resolved[key] == builtin_task.get(key):
            resolved[key] = {"fields": [], "field_types": {}, "metrics": [], "primary_metric": None}[key]
    if resolved["type"] == "json" and not resolved.get("fields"):
        resolved["fields"] = sorted({k for r in references for k in (parse_json_object(r) or {})})
    return resolved


def is_builtin_data(data_path: str, raw_dir: str) -> bool:
    """The run's data is the built-in invoice file (whose task conf/data/invoices.yaml describes)."""
    from pathlib import Path

    return Path(data_path).resolve() == (Path(raw_dir) / "invoices.jsonl").resolve()


def run_task(task: Mapping[str, Any], references: Sequence[str], data_path: str, raw_dir: str) -> dict[str, Any]:
    """data.task as a stage scores it (eval, and make gguf's gate): resolved against the holdout's reference answers
    and the built-in task's own values (resolve_task), then checked (check_task). One rule for both stages, so the
    gate's metric is one that eval reports."""
    from omegaconf import OmegaConf

    from reprotune.config import CONF_DIR

    builtin_task = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "data" / "invoices.yaml").task, resolve=False)
    resolved = resolve_task(task, references, is_builtin_data(data_path, raw_dir), builtin_task)
    check_task(resolved)
    return resolved


def check_task(task: Mapping[str, Any]) -> None:
    """Fail before any model runs if data.task cannot be scored; the message names the bad key."""
    if task.get("type") not in ("json", "text"):
        raise ReprotuneError(f"data.task.type: {task.get('type')!r} is not one of {', '.join(TASK_TYPES)}")
    if task["type"] == "json" and not task.get("fields"):
        raise ReprotuneError("data.task.fields: a json task must list the fields to score")
    for field, type_name in (task.get("field_types") or {}).items():
        if type_name != "any" and type_name not in JSON_TYPES:
            raise ReprotuneError(f"data.task.field_types.{field}: unknown type {type_name!r} "
                                    f"(one of any, {', '.join(JSON_TYPES)})")
    names = set()
    for i, spec in enumerate(task.get("metrics") or []):
        where = f"data.task.metrics[{i}]"
        if not isinstance(spec, Mapping) or "name" not in spec or "kind" not in spec:
            raise ReprotuneError(f"{where}: needs 'name' and 'kind'")
        if spec["name"] in names:
            raise ReprotuneError(f"{where}: duplicate metric name {spec['name']!r}")
        names.add(spec["name"])
        if spec["kind"] not in CUSTOM_KINDS:
            raise ReprotuneError(f"{where}: unknown kind {spec['kind']!r} (one of {', '.join(CUSTOM_KINDS)})")
        if spec["kind"] == "regex":
            try:
                re.compile(spec.get("pattern") or "")
            except re.error as err:
                raise ReprotuneError(f"{where}: bad regex {spec.get('pattern')!r}: {err}") from None
            if not spec.get("pattern") or spec.get("mode", "match") not in ("match", "extract"):
                raise ReprotuneError(f"{where}: regex needs 'pattern' and mode match|extract")
        if spec["kind"] == "json_field" and not ("field" in spec or spec.get("fields")):
            raise ReprotuneError(f"{where}: json_field needs 'field' or 'fields'")
    if task.get("primary_metric") and task["primary_metric"] not in metric_names(task):
        raise ReprotuneError(f"data.task.primary_metric: {task['primary_metric']!r} is not a metric of this "
                             f"{task['type']} task; set data.task.primary_metric to one of "
                             f"{', '.join(metric_names(task))} (or null: the task's own)")


# ---------------------------------------------------------------------------------------------- the task
def metric_names(task: Mapping[str, Any]) -> list[str]:
    if task["type"] == "json":
        names = ["json_valid", "exact_match", "field_accuracy", "schema_ok"]
        names += [f"field/{f}" for f in task.get("fields") or []]
    else:
        names = ["exact_match", "token_f1", "rougeL"]
    return names + [spec["name"] for spec in task.get("metrics") or []]


def primary_metric(task: Mapping[str, Any]) -> str:
    """The one number that ranks examples in the report (worst regressions first)."""
    return task.get("primary_metric") or ("field_accuracy" if task["type"] == "json" else "rougeL")


def score(prediction: str, reference: str, task: Mapping[str, Any]) -> dict[str, float]:
    """All of the task's metrics for one example."""
    if task["type"] == "json":
        scores = json_scores(prediction, reference, task.get("fields") or [], task.get("field_types"))
    else:
        scores = text_scores(prediction, reference)
    for spec in task.get("metrics") or []:
        scores[spec["name"]] = custom_score(spec, prediction, reference)
    return scores


def mean_scores(per_example: Sequence[Mapping[str, float]], names: Sequence[str]) -> dict[str, float]:
    n = len(per_example)
    return {name: sum(s[name] for s in per_example) / n for name in names} if n else {}
