"""What counts as personal data and where: entity types, the patterns and cue words, the name lists."""

from __future__ import annotations

import functools
import logging
import re

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


@functools.cache
def _gendered_names() -> tuple[frozenset[str], frozenset[str]]:
    return _faker_names(("first_names_male",)), _faker_names(("first_names_female",))
