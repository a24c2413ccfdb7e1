"""From Presidio's results to findings: our checks on weak results, private contexts for names, overlaps."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from reprotune.pii.rules import (
    ACCOUNT_CONTEXT,
    ACCOUNT_WORD,
    AMOUNT_SHAPE,
    DATE_SHAPE,
    DOTTED_PHONE_GROUPS,
    MIN_SCORE,
    NAME_HEADER,
    NEAR_OTHER_PII,
    PHONE_CUE,
    PRIORITY,
    PRIVATE_LABEL,
    SECRET_PARAMS,
    SSN_WORD,
    common_words,
    given_names,
)


@dataclass(frozen=True)
class Finding:
    entity: str
    start: int
    end: int


def _url_with_credentials(text: str, start: int, end: int) -> tuple[int, str] | None:
    """If the URL at text[start:end] carries a password or a token, return (start, text with them replaced
    by a marker for each secret part); Presidio's URL pattern stops before user:password@, so look back."""
    back = re.search(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@]+@$", text[:start])
    if back:
        start = back.start()
    url = text[start:end].rstrip(".,;:!?)]}'\"")  # sentence punctuation after a URL is not part of it
    parts = urlsplit(url if "://" in url else "http://" + url)
    secrets = []
    if parts.password:
        secrets.append(parts.password)
    elif parts.username and back:
        secrets.append(parts.username)  # a bare token@host (git over https with a token)
    secrets += [v for k, v in parse_qsl(parts.query, keep_blank_values=False) if SECRET_PARAMS.search(k) and v]
    if not secrets:
        return None
    return start, url


def _phone_shaped(value: str) -> bool:
    """8+ digits and not a date, an amount, a decimal (0.762848570174394) or a version/build number
    (10.0.19041.1234), which phonenumbers' matcher accepts in some regions."""
    value = value.strip(" ()-./")
    if sum(c.isdigit() for c in value) < 8 or DATE_SHAPE.fullmatch(value) or AMOUNT_SHAPE.fullmatch(value):
        return False
    if re.fullmatch(r"\d+(\.\d+)+", value):  # only digits and dots: phone-like only in phone groupings
        return tuple(len(g) for g in value.split(".")) in DOTTED_PHONE_GROUPS
    return True


def _phone_in_context(text: str, start: int, end: int) -> bool:
    """A bare run of digits (no +, spaces or dashes) is an id, an order number or a count unless the text
    before it says phone; formatted numbers need no cue."""
    value = text[start:end].strip()
    if value.isdigit():
        return bool(PHONE_CUE.search(text[max(0, start - 40):start]))
    return True


def column_header(text: str, start: int) -> str:
    """The header cell above text[start] when it sits in a markdown table row ("| Name | SSN |" ... "| Ana | 536221234 |"):
    there the label of a value is its column's header, not the words before it."""
    line_start = text.rfind("\n", 0, start) + 1
    if not text[line_start:start].lstrip().startswith("|"):
        return ""
    column = text[line_start:start].count("|")
    header = line_start
    while header > 0:  # walk up to the first line of the table
        previous = text.rfind("\n", 0, header - 1) + 1
        if not text[previous:header].lstrip().startswith("|"):
            break
        header = previous
    cells = text[header:text.find("\n", header) if "\n" in text[header:] else len(text)].split("|")
    return cells[column] if column < len(cells) else ""


def _keep(result: Any, text: str) -> bool:
    """Our checks on Presidio's weaker findings (phones, bank account numbers, SSNs without separators)."""
    value = text[result.start:result.end]
    if result.entity_type == "PHONE_NUMBER":
        return _phone_shaped(value) and _phone_in_context(text, result.start, result.end)
    if result.entity_type == "US_BANK_NUMBER":
        return bool(ACCOUNT_CONTEXT.search(text[:result.start]) or ACCOUNT_WORD.search(column_header(text, result.start)))
    if result.entity_type == "US_SSN" and result.score < MIN_SCORE:
        return bool(SSN_WORD.search(column_header(text, result.start)))
    if result.entity_type == "URL":
        return True  # decided by _url_with_credentials
    return result.score >= MIN_SCORE


def _private_context(text: str, finding: Finding, others: list[Finding]) -> bool:
    """The name at finding identifies a private person (see PRIVATE_LABEL): a cue right before it, or other
    personal data close by, or an email address spelled from it."""
    if PRIVATE_LABEL.search(text[max(0, finding.start - 60):finding.start]):
        return True
    if NAME_HEADER.search(column_header(text, finding.start)):  # a table's "Name" / "Cliente" column
        return True
    if any(o.entity != "PERSON" and _same_clause(text, finding, o) for o in others):
        return True
    words = [w.lower() for w in re.findall(r"[^\W\d_]{2,}", text[finding.start:finding.end])]
    emails = [text[o.start:o.end].split("@")[0].lower() for o in others if o.entity == "EMAIL_ADDRESS"]
    return any(w in local for w in words for local in emails)


def _same_clause(text: str, a: Finding, b: Finding) -> bool:
    """b is close to a with no sentence end or line break between them ("Contact: Jane Roe, +1 ..."), unlike
    "Grace Hopper was a pioneer. Call +1 ..."."""
    between = text[a.end:b.start] if a.end <= b.start else text[b.end:a.start]
    return len(between) <= NEAR_OTHER_PII and not re.search(r"[.!?](?:\s|$)|\n", between)


def _allowed(value: str, entity: str, allow: frozenset[str]) -> bool:
    """data.pii.allow: a listed term is kept, and so is a name that contains one (case-insensitive)."""
    folded = value.casefold()
    if folded in allow:
        return True
    return entity == "PERSON" and any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", folded) for a in allow)


WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")


def cued_names(text: str) -> list[Finding]:
    """Names right after a cue (Patient:, my name is, Dear, my neighbour...) that NER or the name lists miss:
    a given name alone, or two or three capitalised words that are not common English words."""
    words = list(WORD.finditer(text))
    out, i = [], 0
    while i < len(words):
        first = words[i]
        if not _name_word(first.group(0)) or not PRIVATE_LABEL.search(text[max(0, first.start() - 60):first.start()]):
            i += 1
            continue
        run = [first]
        while len(run) < 3 and i + len(run) < len(words):
            nxt = words[i + len(run)]
            if not (_name_word(nxt.group(0)) and re.fullmatch(r"[ \t]+", text[run[-1].end():nxt.start()])):
                break
            run.append(nxt)
        tokens = [w.group(0) for w in run]
        common = common_words()
        while tokens and tokens[-1].lower() in common:
            tokens.pop()
        if len(tokens) >= 2 and not any(t.lower() in common for t in tokens) or \
                len(tokens) == 1 and tokens[0] in given_names():
            out.append(Finding("PERSON", first.start(), run[len(tokens) - 1].end()))
        i += len(run)
    return out


def _name_word(word: str) -> bool:
    return len(word) > 1 and word[0].isupper() and not word.isupper()


def _trim_quotes(text: str, f: Finding) -> Finding:
    """spaCy's PERSON span can take the closing quote of "...regards, Jane Roe'" with it."""
    start, end = f.start, f.end
    while end > start and text[end - 1] in "'’\"”":
        end -= 1
    while start < end and text[start] in "'‘\"“":
        start += 1
    return Finding(f.entity, start, end)


def detect(analyzer: Any, text: str, entities: set[str], allow: frozenset[str] = frozenset()) -> list[Finding]:
    """Non-overlapping findings in text (the longer span wins an overlap, e.g. a URL over an email in it)."""
    findings = []
    for result in analyzer.analyze(text=text, language="en"):
        if not _keep(result, text):
            continue
        entity = {"US_BANK_NUMBER": "BANK_ACCOUNT", "URL": "URL_CREDENTIALS"}.get(result.entity_type, result.entity_type)
        if entity not in entities:
            continue
        if entity == "URL_CREDENTIALS":
            found = _url_with_credentials(text, result.start, result.end)
            if found is None:
                continue
            findings.append(Finding(entity, found[0], found[0] + len(found[1])))
        else:
            findings.append(Finding(entity, result.start, result.end))
    if "PERSON" in entities:
        findings = [_trim_quotes(text, f) if f.entity == "PERSON" else f for f in findings] + cued_names(text)
    findings = [f for f in findings if not _allowed(text[f.start:f.end], f.entity, allow)]
    findings = [f for f in findings if f.entity != "PERSON" or _private_context(text, f, findings)]
    # longer span first; on a tie the more specific type (an account number with its context is not a phone)
    findings.sort(key=lambda f: (-(f.end - f.start), PRIORITY.index(f.entity), f.start))
    chosen: list[Finding] = []
    for f in findings:
        if all(f.end <= c.start or c.end <= f.start for c in chosen):
            chosen.append(f)
    return sorted(chosen, key=lambda f: f.start)
