"""PII scrubbing for the prepare stage: detect with Presidio, replace with consistent, realistic fakes.

Detection is Microsoft Presidio's AnalyzerEngine with its own recognizers, validated by the libraries
they use (phonenumbers for phones, Luhn for cards, ISO 7064 for IBANs, checksums for Spanish DNI/NIE),
configured for the shapes people write (recognizers.py), plus one recognizer of ours for person names
(spaCy NER gated by a given-name list, see PersonRecognizer). Replacement keeps the *shape* the model must
learn: a Visa number stays a 16-digit Luhn-valid Visa number in the same grouping, an IBAN stays a valid
IBAN of the same country, a phone keeps its country code and separators. Each fake is derived from (seed,
entity type, original value), so the same value becomes the same fake everywhere in the dataset and in
every run, and appending data changes nothing already scrubbed.

Only counts leave this package for the report (`ScrubReport`), never an original value.

    rules.py        entity types, patterns, cue words, name lists
    recognizers.py  the Presidio AnalyzerEngine (recognizers and their configuration)
    detection.py    Presidio's results -> findings (weak results checked, names only in private contexts)
    fakes.py        same-shape fakes and the seeded Replacer
    scrubber.py     the dataset-level Scrubber, the report, scrub_records (what prepare and pii-review call)
"""

from __future__ import annotations

from reprotune.pii.detection import Finding, column_header, cued_names, detect
from reprotune.pii.fakes import (
    Replacer,
    fake_credit_card,
    fake_dni,
    fake_iban,
    fake_nie,
    fake_person,
    fake_phone,
    fake_ssn,
    fake_url,
    same_case,
)
from reprotune.pii.recognizers import NER_CHUNK, NER_OVERLAP, build_analyzer, text_chunks
from reprotune.pii.rules import (
    ENTITIES,
    PRIORITY,
    ScrubberUnavailable,
    _gendered_names,
    given_names,
    surnames,
)
from reprotune.pii.scrubber import (
    Scrubber,
    ScrubReport,
    detector_info,
    map_texts,
    message_texts,
    scrub_records,
)

__all__ = [
    "ENTITIES", "NER_CHUNK", "NER_OVERLAP", "PRIORITY", "Finding", "Replacer", "ScrubReport", "Scrubber",
    "ScrubberUnavailable", "_gendered_names", "build_analyzer", "column_header", "cued_names", "detect",
    "detector_info", "fake_credit_card", "fake_dni", "fake_iban", "fake_nie", "fake_person", "fake_phone",
    "fake_ssn", "fake_url", "given_names", "map_texts", "message_texts", "same_case", "scrub_records", "surnames",
    "text_chunks",
]
