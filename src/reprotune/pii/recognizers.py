"""The Presidio AnalyzerEngine we use: Presidio's recognizers configured for the shapes people write,
our gated spaCy person recognizer (in chunks), an offline email recognizer."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

from reprotune.pii.detection import _phone_shaped
from reprotune.pii.rules import (
    CALENDAR_WORDS,
    CARD_PATTERN,
    DNI_PATTERN,
    IBAN_PATTERN,
    IP_IN_HOST,
    NIE_PATTERN,
    ORG_WORDS,
    PHONE_CANDIDATE,
    PRIVATE_EMAIL_TLD,
    QUOTED_EMAIL,
    RESERVED_EMAIL_DOMAIN,
    SALUTATIONS,
    SSN_FAMOUS,
    SSN_LABELLED,
    SURNAME_AFTER_WORD,
    TITLES,
    ScrubberUnavailable,
    common_words,
    given_names,
    surnames,
)


@functools.cache
def _load_ner(model_name: str) -> Any:
    """The pinned spaCy pipeline with only its NER (it has its own tok2vec): 3-4x faster than the full one."""
    import spacy

    try:
        nlp = spacy.load(model_name, exclude=["tok2vec", "tagger", "parser", "senter", "attribute_ruler",
                                              "lemmatizer"])
    except OSError as err:
        raise ScrubberUnavailable(
            f"name detection model '{model_name}' is not installed (it is in the lockfiles: run 'make venv'); "
            f"or set data.pii.names=false to scrub everything but names") from err
    return nlp


NER_CHUNK = 100_000  # characters per NER call: spaCy refuses texts over 1,000,000 ([E088]), and its memory grows with the text
NER_OVERLAP = 1_000  # characters two chunks share, so a name on a chunk edge is whole in one of them


def text_chunks(text: str, size: int = NER_CHUNK, overlap: int = NER_OVERLAP) -> list[tuple[int, str]]:
    """(offset, chunk) pieces of text of at most `size` characters that overlap by about `overlap`, cut at
    whitespace where there is some (a name is never cut in the chunk that holds it whole)."""
    if len(text) <= size:
        return [(0, text)]
    chunks, start = [], 0
    while True:
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", start + overlap, end), text.rfind("\n", start + overlap, end))
            end = cut if cut > start + overlap else end
        chunks.append((start, text[start:end]))
        if end >= len(text):
            return chunks
        nxt = end - overlap
        space = max(text.rfind(" ", start + 1, nxt), text.rfind("\n", start + 1, nxt))
        start = space + 1 if space > start else nxt


# -------------------------------------------------------------------------------------------------- names
WORD = re.compile(r"[^\W\d_]+")


def may_have_name(text: str, given: set[str], family: set[str]) -> bool:
    """Cheap gate before the NER: a known given name that could pass person_span's rules (most texts of a task
    dataset have none, and the NER is the slow part)."""
    for match in WORD.finditer(text):
        word = match.group(0)
        if word not in given or word.lower() in CALENDAR_WORDS:
            continue
        line_start = match.start() == 0 or text[:match.start()].rstrip(" \t")[-1:] in ("\n", ".", "!", "?", ":", "")
        followed_by_name = re.match(r"[ \t]+[A-Z]", text[match.end():]) is not None
        if followed_by_name or not line_start:
            return True
    return any(m.group(2) in family and m.group(1).lower() not in common_words()
               for m in SURNAME_AFTER_WORD.finditer(text))


def person_span(doc: Any, ent: Any, given: set[str], known_first: bool = True) -> tuple[int, int] | None:
    """The characters of a person's name in a spaCy span, or None when it does not look like one (see
    PersonRecognizer's rules)."""
    tokens = [t for t in ent if not t.is_space]
    while tokens and (tokens[0].lower_ in TITLES or tokens[0].lower_ in SALUTATIONS):
        tokens = tokens[1:]
    if not tokens or len(tokens) > 4 or "\n" in ent.text:
        return None
    for t in tokens:
        if t.text in (".", "-", "'"):
            continue  # initials (J. R.), hyphenated and O'Brien-style names
        word = t.text.replace("-", "").replace("'", "").rstrip(".")
        if not word.isalpha() or not word[0].isupper() or (len(word) > 1 and word.isupper()):
            return None  # digits, codes (JPY, x3), lower-case words: not a name
    if known_first and tokens[0].text not in given:
        return None
    following = list(doc[ent.end:ent.end + 3])
    # "Smith & Sons Ltd", "Kowalski & Synowie": a legal form or company word in or just after the span
    if any(t.lower_ in ORG_WORDS for t in tokens) or any(t.lower_ in ORG_WORDS for t in following):
        return None
    if len(tokens) == 1:
        first = tokens[0]
        line_start = first.i == 0 or "\n" in doc[first.i - 1].text_with_ws or doc[first.i - 1].is_punct \
            and doc[first.i - 1].text in ".!?:"
        if line_start or first.lower_ in CALENDAR_WORDS:
            return None
    return tokens[0].idx, tokens[-1].idx + len(tokens[-1].text)


def names_in(doc: Any, given: set[str], family: set[str]) -> list[tuple[int, int]]:
    """The person names of a spaCy doc: its PERSON entities that look like names, and known given name + known
    surname pairs the model missed, none inside a longer ORG entity."""
    # an ORG entity that is exactly a given name + surname is the small model's mistake ("Customer
    # record for Nadia Lindqvist: ..."); one that is longer holds the name (Soluciones Hidalgo S.L.)
    orgs = [(e.start_char, e.end_char) for e in doc.ents if e.label_ == "ORG"]
    spans = [person_span(doc, ent, given) for ent in doc.ents if ent.label_ == "PERSON"]
    # The small model misses many names in terse business text ("Contact: María García, +34 ...");
    # a known given name followed by a known surname is a name too (both from Faker's lists).
    # A capitalised word that is not a common English word before a known surname is a given name the
    # lists lack (Rahul Raman, Chinonso Okafor); it still needs a private context to be replaced.
    common = common_words()
    spans += [(t.idx, nxt.idx + len(nxt.text)) for t, nxt in zip(doc, doc[1:], strict=False)
              if nxt.text in family and t.whitespace_ == " "
              and (t.text in given or t.lower_ not in common and t.text.istitle())
              and person_span(doc, doc[t.i:nxt.i + 1], given, known_first=t.text in given) is not None]
    return [(start, end) for start, end in sorted(set(filter(None, spans)))
            if not any(s < end and start < e and (s, e) != (start, end) for s, e in orgs)]


def _make_person_recognizer(model_name: str) -> Any:
    from presidio_analyzer import LocalRecognizer, RecognizerResult

    class PersonRecognizer(LocalRecognizer):
        """spaCy PERSON entities, kept only when they look like a person's name.

        The small English model tags many capitalised phrases in business text as PERSON ("Bill from ...",
        "Soluciones Hidalgo S.L.", "JPY"). We keep a PERSON span only if its first word (after a title such
        as Mr/Dr) is a known given name, no word is a digit string or a legal form, it is not inside an ORG
        entity, and a one-word name is not the first word of a line or a month/day name.
        """

        def __init__(self) -> None:
            super().__init__(supported_entities=["PERSON"], name="PersonRecognizer", supported_language="en")

        def load(self) -> None:
            self.nlp = _load_ner(model_name)
            self.names = given_names()
            self.surnames = surnames()

        def analyze(self, text: str, entities: list[str], nlp_artifacts: Any = None) -> list:
            if not may_have_name(text, self.names, self.surnames):
                return []
            spans: set[tuple[int, int]] = set()
            for offset, chunk in text_chunks(text):
                # the gate per chunk
                if offset == 0 and len(chunk) == len(text) or may_have_name(chunk, self.names, self.surnames):
                    spans |= {(start + offset, end + offset)
                              for start, end in names_in(self.nlp(chunk), self.names, self.surnames)}
            return [RecognizerResult("PERSON", start, end, 0.85) for start, end in sorted(spans)]

    return PersonRecognizer()


def _make_email_recognizer() -> Any:
    import tldextract
    from presidio_analyzer import Pattern
    from presidio_analyzer.predefined_recognizers import EmailRecognizer

    # tldextract's module-level extract() downloads the public suffix list; the bundled snapshot is enough
    # and nothing leaves the machine.
    extract = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

    class OfflineEmailRecognizer(EmailRecognizer):
        def validate_result(self, pattern_text: str) -> bool:
            domain = pattern_text.rsplit("@", 1)[-1].lower().strip("[]")
            if IP_IN_HOST.search(domain):
                return True  # the host is an IP address (dashed or dotted), even under a reserved domain
            if RESERVED_EMAIL_DOMAIN.search(domain):
                return False  # example.com & co. (RFC 2606) cannot be anyone's mailbox: not personal data
            if PRIVATE_EMAIL_TLD.search(domain):
                return True
            return extract(pattern_text.rsplit("@", 1)[-1]).fqdn != ""

    patterns = [*EmailRecognizer.PATTERNS, Pattern("Email (quoted local part)", QUOTED_EMAIL, 0.5),
                Pattern("Email (IP literal)", r"\b[\w.+-]+@\[(?:\d{1,3}\.){3}\d{1,3}\]", 0.5)]
    return OfflineEmailRecognizer(patterns=patterns)


def _pattern_recognizers(phone_regions: Iterable[str]) -> list:
    """Presidio's pattern recognizers as we configure them (the shapes people write), the phone one gated."""
    from presidio_analyzer import Pattern, PatternRecognizer
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EsNieRecognizer,
        EsNifRecognizer,
        IbanRecognizer,
        IpRecognizer,
        PhoneRecognizer,
        UrlRecognizer,
        UsBankRecognizer,
        UsSsnRecognizer,
    )

    class GatedPhoneRecognizer(PhoneRecognizer):
        """phonenumbers' matcher costs ~5 ms per text and region; run it only where a phone could be: a run
        of 8+ digits with phone separators that is not a date or an amount (the checks of _keep, below)."""

        def analyze(self, text: str, entities: list[str], nlp_artifacts: Any = None) -> list:
            if not any(_phone_shaped(m.group(0)) for m in PHONE_CANDIDATE.finditer(text)):
                return []
            return super().analyze(text, entities, nlp_artifacts)

    ssn_in_context = PatternRecognizer(
        "US_SSN", name="LabelledSsnRecognizer",
        patterns=[Pattern("SSN after an SSN label", SSN_LABELLED, 0.9), Pattern("SSA sample SSN", SSN_FAMOUS, 0.9)])
    # Presidio's own patterns, widened to the groupings people write (#28's benchmark): dots as well as
    # spaces and dashes; Mastercard's 2-series; lower-case IBANs; DNI as 12.345.678-Z, NIE as X-1234567-L.
    # The checksums (Luhn, ISO 7064, mod 23) still decide, after the same separators are removed.
    separators = [("-", ""), (" ", ""), (".", "")]

    class AnyCaseIbanRecognizer(IbanRecognizer):
        """es91 2100 ... is the same account as ES91 2100 ...; Presidio's ISO 7064 check reads capitals only."""

        def validate_result(self, pattern_text: str) -> bool | None:
            return super().validate_result(pattern_text.upper())

    return [
        _make_email_recognizer(), GatedPhoneRecognizer(supported_regions=tuple(phone_regions)),
        AnyCaseIbanRecognizer(patterns=[Pattern("IBAN (any grouping)", IBAN_PATTERN, 0.5)], replacement_pairs=separators,
                              regex_flags=re.DOTALL | re.MULTILINE | re.IGNORECASE),
        UsBankRecognizer(), CreditCardRecognizer(patterns=[Pattern("Credit card (any grouping)", CARD_PATTERN, 0.3)],
                                                 replacement_pairs=separators),
        IpRecognizer(), UsSsnRecognizer(), ssn_in_context,
        EsNifRecognizer(supported_language="en", patterns=[Pattern("NIF (any grouping)", DNI_PATTERN, 0.5)],
                        replacement_pairs=separators),
        EsNieRecognizer(supported_language="en", patterns=[Pattern("NIE (any grouping)", NIE_PATTERN, 0.5)],
                        replacement_pairs=separators),
        UrlRecognizer(),
    ]


def build_analyzer(names: bool, ner_model: str, phone_regions: Iterable[str]) -> Any:
    """A Presidio AnalyzerEngine with exactly the recognizers we use, all offline.

    The NLP engine is Presidio's no-op one: pattern recognizers need no tokens, and PERSON comes from
    our gated recognizer, which runs spaCy only on texts that contain a given name.
    """
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import NoOpNlpEngine

    registry = RecognizerRegistry(supported_languages=["en"])
    recognizers = _pattern_recognizers(phone_regions)
    if names:
        recognizers.append(_make_person_recognizer(ner_model))
    for recognizer in recognizers:
        registry.add_recognizer(recognizer)
    return AnalyzerEngine(registry=registry, nlp_engine=NoOpNlpEngine(models=[{"lang_code": "en", "model_name": "no_op"}]),
                          supported_languages=["en"])
