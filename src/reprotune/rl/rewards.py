"""GRPO's reward functions (objective.rewards), in TRL's reward-function signature
`f(prompts, completions, **kwargs) -> list[float | None]` (trl/trainer/grpo_trainer.py, `_calculate_rewards`: the
prompt dataset's other columns, e.g. `answer`, arrive as keyword lists, one value per completion).

objective.rewards lists them, each one of:
    json_valid                              1 when the completion is a JSON object (a ``` fence allowed), else 0
    field_accuracy                          the share of the reference object's fields the completion gets right
    {name: field_accuracy, fields: [a, b]}  (reprotune.metrics.json_scores: the eval's own scoring), column: the
                                            `answer` column (`column: <name>` names another)
    {name: exact_match, normalize: strip}   1 when the completion equals the reference (strip|lower|none; two JSON
                                            objects: equal as JSON values, key order and spacing aside)
    {name: regex, pattern: '...', full: false}  1 when the pattern is found (full: the whole completion matches)
    {name: json_schema, schema: {...}}      1 when the completion is JSON that the schema accepts (the subset in
                                            `schema_problem`: type, properties, required, additionalProperties,
                                            enum, items, minimum, maximum, minLength, maxLength)
    {name: length, max: 64, min: 0}         1 for min..max completion tokens, falling linearly to 0 at 0 and 2 x max
    path/to/file.py:function                the user's own (or {name: path/to/file.py:function, weight...}: the other
                                            keys are passed to it as keyword arguments)
A user's reward file is imported by `load_rewards`, which only the train stage calls (never make plan or prepare:
`check_rewards` checks the specs without importing anything), and its sha256 is recorded in the train manifest.

Every reward runs inside `checked`: a reward that raises, returns a list of the wrong length, or returns a value
that is not a finite number (None is TRL's "does not apply" and passes) stops the run with one line naming the
function, the completion's index in the generation batch, its prompt and the value. Each call's prompts,
completions and rewards are kept by a `Rollouts` (written to paths.rollouts by the train stage).

Pure: imports reprotune.metrics and reprotune.errors; the user's file only when load_rewards runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError
from reprotune.metrics import _normalize, _same_value, json_scores, parse_json_object

RewardFunc = Callable[..., list]
DEFAULT_REFERENCE = "answer"


# --------------------------------------------------------------------------------------------- helpers
def completion_text(completion: Any) -> str:
    """A completion as text: TRL passes a string (standard prompts) or a list of messages (conversational)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")


def references(kwargs: Mapping[str, Any], column: str, name: str, n: int) -> list[Any]:
    """The reference column TRL passed (one value per completion); one line when the prompts have none."""
    values = kwargs.get(column)
    if values is None:
        raise ReprotuneError(f"objective.rewards: {name}: the prompts have no {column!r} column (the reference it "
                             f"reads; prepare prompts with reference answers, or set column: <name>)")
    return list(values)[:n]


# ------------------------------------------------------------------------------------------- built-ins
def json_valid(completions: Sequence[Any], **_: Any) -> list[float]:
    return [float(parse_json_object(completion_text(c)) is not None) for c in completions]


def field_accuracy(completions: Sequence[Any], fields: Sequence[str] = (), column: str = DEFAULT_REFERENCE,
                   **kwargs: Any) -> list[float]:
    refs = references(kwargs, column, "field_accuracy", len(completions))
    return [json_scores(completion_text(c), str(r), list(fields))["field_accuracy"]
            for c, r in zip(completions, refs, strict=True)]


def exact_match(completions: Sequence[Any], normalize: str = "strip", column: str = DEFAULT_REFERENCE,
                **kwargs: Any) -> list[float]:
    refs = references(kwargs, column, "exact_match", len(completions))
    return [float(_exact(completion_text(c), str(r), normalize)) for c, r in zip(completions, refs, strict=True)]


def _exact(text: str, ref: str, normalize: str) -> bool:
    got, want = parse_json_object(text), parse_json_object(ref)
    if want is not None:  # a JSON answer: the same object (as eval's exact_match scores it), spacing aside
        return got is not None and set(got) == set(want) and all(_same_value(got[k], want[k]) for k in want)
    return _normalize(text, normalize) == _normalize(ref, normalize)


def regex(completions: Sequence[Any], pattern: str = "", full: bool = False, **_: Any) -> list[float]:
    compiled = re.compile(pattern, re.DOTALL)
    match = compiled.fullmatch if full else compiled.search
    return [float(match(completion_text(c).strip() if full else completion_text(c)) is not None)
            for c in completions]


def length(completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None, max: int = 0,
           min: int = 0, **_: Any) -> list[float]:  # noqa: A002 (the config's key names)
    """1 for min..max tokens; below min it falls linearly to 0 at 0 tokens, above max to 0 at 2 x max."""
    counts = [len(ids) for ids in completion_ids] if completion_ids is not None else \
        [len(completion_text(c).split()) for c in completions]
    return [_length_score(n, int(min), int(max)) for n in counts]


def _length_score(n: int, low: int, high: int) -> float:
    if n < low:
        return n / low
    if n > high:
        return max(0.0, 1.0 - (n - high) / high)
    return 1.0


def json_schema(completions: Sequence[Any], schema: Mapping[str, Any] | None = None, **_: Any) -> list[float]:
    return [float((obj := _json_value(completion_text(c))) is not _INVALID and schema_problem(obj, schema or {}) is None)
            for c in completions]


_INVALID = object()


def _json_value(text: str) -> Any:
    obj = parse_json_object(text)
    if obj is not None:
        return obj
    try:
        return json.loads(text.strip())
    except (json.JSONDecodeError, RecursionError):
        return _INVALID


SCHEMA_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}
SCHEMA_KEYS = ("type", "properties", "required", "additionalProperties", "enum", "items", "minimum", "maximum",
               "minLength", "maxLength", "description", "title", "$schema")


def schema_problem(value: Any, schema: Mapping[str, Any], where: str = "$") -> str | None:
    """The first way `value` breaks `schema` (a JSON Schema subset: SCHEMA_KEYS), or None. No `jsonschema` package
    is in the lock; the subset covers what an extraction task's schema says."""
    types = schema.get("type")
    if types is not None and not any(SCHEMA_TYPES[t](value) for t in ([types] if isinstance(types, str) else types)):
        return f"{where}: not {types}"
    if "enum" in schema and not any(_same_value(value, e) for e in schema["enum"]):
        return f"{where}: not one of the enum"
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                return f"{where}.{key}: missing"
        props = schema.get("properties") or {}
        for key, sub in value.items():
            if key in props:
                if found := schema_problem(sub, props[key], f"{where}.{key}"):
                    return found
            elif schema.get("additionalProperties") is False:
                return f"{where}.{key}: not allowed"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            if found := schema_problem(item, schema["items"], f"{where}[{i}]"):
                return found
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and (value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf)):
        return f"{where}: out of range"
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", math.inf):
        return f"{where}: wrong length"
    return None


def check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, Mapping):
        raise ReprotuneError(f"{where}.schema: a JSON Schema object is required")
    for key, sub in schema.items():
        if key not in SCHEMA_KEYS:
            raise ReprotuneError(f"{where}.schema: {key!r} is not supported (one of {', '.join(SCHEMA_KEYS)})")
        if key == "type" and any(t not in SCHEMA_TYPES for t in ([sub] if isinstance(sub, str) else sub)):
            raise ReprotuneError(f"{where}.schema.type: {sub!r} is not one of {', '.join(SCHEMA_TYPES)}")
        if key == "properties":
            for name, prop in sub.items():
                check_schema(prop, f"{where}.schema.properties.{name}")
        if key == "items":
            check_schema(sub, f"{where}.schema.items")


# what each built-in takes besides the completions (and the reference column)
BUILTINS: dict[str, tuple[RewardFunc, tuple[str, ...]]] = {
    "json_valid": (json_valid, ()),
    "field_accuracy": (field_accuracy, ("fields", "column")),
    "exact_match": (exact_match, ("normalize", "column")),
    "regex": (regex, ("pattern", "full")),
    "json_schema": (json_schema, ("schema",)),
    "length": (length, ("max", "min")),
}
USER_REWARD = re.compile(r"^(?P<file>.+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class RewardSpec:
    """One entry of objective.rewards: a built-in's name or a user's `file.py:function`, and its parameters."""
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    index: int = 0

    @property
    def where(self) -> str:
        return f"objective.rewards[{self.index}]"

    @property
    def user_file(self) -> Path | None:
        found = USER_REWARD.match(self.name)
        return Path(found["file"]) if found else None

    @property
    def label(self) -> str:
        """The name TRL logs it under (rewards/<label>/mean) and rollouts.jsonl keys it by."""
        found = USER_REWARD.match(self.name)
        return found["function"] if found else self.name


def parse_specs(rewards: Any) -> list[RewardSpec]:
    """objective.rewards (a list of names or {name: ..., params...}) as RewardSpecs; one line per bad entry."""
    if not isinstance(rewards, Sequence) or isinstance(rewards, str) or not rewards:
        raise ReprotuneError("objective.rewards: a non-empty list of reward names (json_valid, field_accuracy, "
                             "exact_match, regex, json_schema, length) or path/to/file.py:function")
    specs = []
    for i, entry in enumerate(rewards):
        if isinstance(entry, str):
            specs.append(RewardSpec(entry, {}, i))
        elif isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            specs.append(RewardSpec(entry["name"], {k: v for k, v in entry.items() if k != "name"}, i))
        else:
            raise ReprotuneError(f"objective.rewards[{i}]: {entry!r}: a name or a mapping with 'name'")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        dup = next(x for x in labels if labels.count(x) > 1)
        raise ReprotuneError(f"objective.rewards: {dup!r} twice (each reward is logged under its own name)")
    return specs


def check_spec(spec: RewardSpec) -> None:
    """What can be checked without importing a user's file: the name, the parameters, the file's existence."""
    if spec.user_file is not None:
        if not spec.user_file.is_file():
            raise ReprotuneError(f"{spec.user_file}:0: {spec.where}: {spec.name!r}: no such file")
        return
    if spec.name not in BUILTINS:
        raise ReprotuneError(f"{spec.where}: {spec.name!r} is not one of {', '.join(BUILTINS)} "
                             "(or path/to/file.py:function)")
    _, takes = BUILTINS[spec.name]
    unknown = sorted(set(spec.params) - set(takes))
    if unknown:
        raise ReprotuneError(f"{spec.where}.{unknown[0]}: {spec.name} takes {', '.join(takes) or 'no parameters'}")
    if spec.name == "regex":
        try:
            re.compile(str(spec.params.get("pattern") or ""))
        except re.error as err:
            raise ReprotuneError(f"{spec.where}.pattern: bad regex: {err}") from None
        if not spec.params.get("pattern"):
            raise ReprotuneError(f"{spec.where}.pattern: regex needs a pattern")
    if spec.name == "length":
        high, low = spec.params.get("max"), spec.params.get("min", 0)
        if not isinstance(high, int) or high < 1 or not isinstance(low, int) or not 0 <= low <= high:
            raise ReprotuneError(f"{spec.where}.max: length needs integers 0 <= min <= max, max >= 1")
    if spec.name == "json_schema":
        check_schema(spec.params.get("schema"), spec.where)
    if spec.name in ("exact_match",) and spec.params.get("normalize", "strip") not in ("strip", "lower", "none"):
        raise ReprotuneError(f"{spec.where}.normalize: one of strip, lower, none")


def check_rewards(rewards: Any, weights: Any = None) -> list[RewardSpec]:
    """Every spec checked (no user file imported): make plan, prepare and train's start call this."""
    specs = parse_specs(rewards)
    for spec in specs:
        check_spec(spec)
    if weights is not None and len(list(weights)) != len(specs):
        raise ReprotuneError(f"objective.reward_weights: {len(list(weights))} weights for {len(specs)} rewards")
    return specs


# ------------------------------------------------------------------------------------------- loading
def import_user_reward(spec: RewardSpec) -> RewardFunc:
    """The user's function, imported from its file (train only: the file runs its top level now)."""
    path = spec.user_file
    assert path is not None
    module_name = f"reprotune_user_reward_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ReprotuneError(f"{path}:0: {spec.where}: cannot be imported as Python")
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 (any error of the user's file is theirs: one line)
        raise ReprotuneError(f"{path}:0: {spec.where}: importing it failed: {type(err).__name__}: {err}") from None
    func = getattr(module, spec.label, None)
    if not callable(func):
        raise ReprotuneError(f"{path}:0: {spec.where}: defines no function {spec.label!r}")
    return func


def bound(spec: RewardSpec) -> RewardFunc:
    """The spec's function with its parameters bound."""
    func = import_user_reward(spec) if spec.user_file is not None else BUILTINS[spec.name][0]
    params = dict(spec.params)

    def reward(prompts: list, completions: list, **kwargs: Any) -> list:
        return func(prompts=prompts, completions=completions, **{**kwargs, **params})

    return reward


def file_records(specs: Sequence[RewardSpec], root: Path) -> list[dict[str, Any]]:
    """The manifest's rewards: each name, parameters, and a user's file by sha256 (relative to paths.root)."""
    from reprotune import manifest as mf

    return [{"name": s.name, "label": s.label, "params": s.params,
             **({"file": mf.path_record(s.user_file, root)} if s.user_file is not None else {})} for s in specs]


# ------------------------------------------------------------------------------------ checked, recorded
@dataclass
class Rollouts:
    """Every generation batch's prompts, completions and each reward's values, in the order TRL scored them; with
    a `path`, each batch is appended to it (JSONL, one completion a line) once its last reward has scored it, so a
    killed run keeps what it generated. The first batch a run scores cuts the file back to the rows of the steps
    before it: a fresh run (step 0) starts it empty, a resumed one keeps what the killed run sampled before its
    checkpoint, so a resumed run's file is the uninterrupted run's."""
    labels: list[str]
    path: Path | None = None
    batches: list[dict[str, Any]] = field(default_factory=list)

    def record(self, label: str, step: int, prompts: list, completions: list, values: list) -> None:
        # TRL calls the rewards one after the other on the same batch: the first opens a new batch
        if label == self.labels[0]:
            if not self.batches and self.path is not None:
                self._keep_before(step)
            self.batches.append({"step": step, "prompts": prompts, "completions": completions, "rewards": {}})
        self.batches[-1]["rewards"][label] = values
        if label == self.labels[-1] and self.path is not None:
            with self.path.open("a", encoding="utf-8") as out:
                out.write("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n"
                                  for r in self._rows(self.batches[-1])))

    def _keep_before(self, step: int) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True) if self.path.is_file() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] < step] if step else []
        self.path.write_text("".join(kept), encoding="utf-8")

    def _rows(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"step": batch["step"], "index": i, "prompt": p, "completion": c,
                 "rewards": {label: batch["rewards"].get(label, [None] * len(batch["prompts"]))[i]
                             for label in self.labels}}
                for i, (p, c) in enumerate(zip(batch["prompts"], batch["completions"], strict=True))]

    def rows(self) -> list[dict[str, Any]]:
        return [row for batch in self.batches for row in self._rows(batch)]


def _short(value: Any) -> str:
    """A prompt in a few characters: its text, or a conversation's last turn (the one answered)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict) and isinstance(value[-1].get("content"), str):
        value = value[-1]["content"]
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return repr(text[:60] + ("…" if len(text) > 60 else ""))


def _bad_value(value: Any) -> bool:
    if value is None:
        return False  # TRL's "this reward does not apply to this completion"
    return isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)


def _raising_index(func: RewardFunc, prompts: list, completions: list, kwargs: dict[str, Any]) -> int | None:
    """Which completion makes `func` raise: each scored alone (the per-completion columns sliced with it)."""
    n = len(prompts)
    for i in range(n):
        one = {k: v[i:i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
        try:
            func(prompts=prompts[i:i + 1], completions=completions[i:i + 1], **one)
        except Exception:  # noqa: BLE001 (probing which completion fails)
            return i
    return None


def checked(func: RewardFunc, label: str, rollouts: Rollouts) -> RewardFunc:
    """`func` under reprotune's rules (the module docstring): a bad reward is one line, a good one recorded."""
    def reward(prompts: list, completions: list, **kwargs: Any) -> list:
        state = kwargs.get("trainer_state")
        step = int(state.global_step) if state is not None else 0
        try:
            values = func(prompts=prompts, completions=completions, **kwargs)
        except ReprotuneError:
            raise
        except Exception as err:  # noqa: BLE001 (any failure of a reward stops the run in one line)
            i = _raising_index(func, prompts, completions, kwargs)
            at = f"completion {i} (prompt {_short(prompts[i])})" if i is not None else "the batch"
            raise ReprotuneError(f"reward {label}: raised {type(err).__name__}: {err} at step {step}, {at}") from None
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != len(prompts):
            n = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise ReprotuneError(f"reward {label}: returned {n} values for {len(prompts)} completions at step {step}")
        for i, value in enumerate(values):
            if _bad_value(value):
                raise ReprotuneError(f"reward {label}: completion {i} (prompt {_short(prompts[i])}) at step {step}: "
                                     f"returned {value!r}, not a finite number")
        values = [None if v is None else float(v) for v in values]
        rollouts.record(label, step, list(prompts), list(completions), values)
        return values

    reward.__name__ = reward.__qualname__ = label  # TRL logs rewards/<__name__>/mean
    return reward


def load_rewards(rewards: Any, weights: Any = None, rollouts_file: Path | None = None
                 ) -> tuple[list[RewardFunc], list[RewardSpec], Rollouts]:
    """The reward functions TRL's GRPOTrainer gets (checked, recorded), their specs and the shared Rollouts
    (writing rollouts_file, where given). Imports the users' files: the train stage's start only."""
    specs = check_rewards(rewards, weights)
    funcs = [bound(s) for s in specs]  # every import before the rollouts file is started
    rollouts = Rollouts([s.label for s in specs], rollouts_file)
    return [checked(f, s.label, rollouts) for f, s in zip(funcs, specs, strict=True)], specs, rollouts
