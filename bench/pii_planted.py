"""An adversarial planted-PII corpus (#28): every entity class the scrubber claims, in many shapes, contexts
and two languages, generated deterministically; and the scoring of a scrubbed copy of it.

    python bench/pii_planted.py [--seed 0] [--show-misses 20]     (bench/pii_quality.py runs it too)

Each record plants exactly one value (some a name as well), so a miss is attributed to one
(class, shape, context, language). Shapes are what people and systems write: emails with sub-domains,
IP-bearing, punycode and private hosts, plus-addressing, quoted local parts, upper case; cards and IBANs
with spaces, dashes, dots or none; phones national and international (phonenumbers-valid numbers of the
default phone_regions); SSNs valid, the SSA's sample numbers, labels near and far; DNI/NIE with and
without separators; account numbers; URLs with passwords and tokens; private names after every cue.
Contexts: prose, a JSON answer, tool-call arguments and results, a system prompt, a markdown table, and a
multi-turn conversation where the value comes late. Recall: the value (and its JSON-escaped spelling) is
gone from every text of its record; names case-insensitively. Structured answers must stay valid JSON
with a value of the same shape where the original was.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Identifier classes that must reach 100% (#28); PERSON is held to >= 95%.
STRUCTURED = ("EMAIL_ADDRESS", "PHONE_NUMBER", "IBAN_CODE", "BANK_ACCOUNT", "CREDIT_CARD", "IP_ADDRESS", "US_SSN",
              "ES_NIF", "ES_NIE", "URL_CREDENTIALS")
LANGS = ("en", "es")
CONTEXTS = ("prose", "json_answer", "tool_call", "system_prompt", "table", "multi_turn")
FIRST = ["Priya", "Tomasz", "Aoife", "Mateo", "Ingrid", "Kwame", "Sofia", "Lars", "Amara", "Dmitri", "Chloe",
         "Rahul", "Elena", "Jonas", "Fatima", "Hugo", "Nadia", "Pavel", "Leila", "Oscar", "Lucía", "Álvaro",
         "Begoña", "Iñaki", "Nuria", "Joaquín", "Chinonso", "Siobhán", "José Luis", "María José"]
LAST = ["Raman", "Nowak", "Gallagher", "Herrera", "Lindqvist", "Mensah", "Ricci", "Eriksen", "Okafor", "Volkov",
        "Dubois", "Mehta", "Popescu", "Becker", "Haddad", "Moreau", "Kowalczyk", "Farah", "Whitfield", "Adeyemi",
        "Serrano", "Hofmann", "Ibáñez", "Muñoz", "García Pérez", "Núñez", "O'Brien", "Fernández-Vega"]
# (English label, Spanish label) said next to a value of the class, as a person would
LABELS = {"EMAIL_ADDRESS": ("email", "correo"), "PHONE_NUMBER": ("phone", "teléfono"), "IBAN_CODE": ("IBAN", "IBAN"),
          "BANK_ACCOUNT": ("account number", "número de cuenta"), "CREDIT_CARD": ("card", "tarjeta"),
          "IP_ADDRESS": ("IP", "IP"), "US_SSN": ("SSN", "SSN"), "ES_NIF": ("DNI", "DNI"), "ES_NIE": ("NIE", "NIE"),
          "URL_CREDENTIALS": ("link", "enlace"), "PERSON": ("name", "nombre")}
FIELD = {"EMAIL_ADDRESS": "email", "PHONE_NUMBER": "phone", "IBAN_CODE": "iban", "BANK_ACCOUNT": "account_number",
         "CREDIT_CARD": "card_number", "IP_ADDRESS": "ip", "US_SSN": "ssn", "ES_NIF": "dni", "ES_NIE": "nie",
         "URL_CREDENTIALS": "url", "PERSON": "customer_name"}


@dataclass
class Plant:
    entity: str
    shape: str
    context: str
    lang: str
    value: str
    name: str  # the private name planted in the same record ("" if none)
    conversation: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)


# --- values: (shape, generator) per class ---------------------------------------------------------------------


def _digits(rng: random.Random, n: int) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(n))


def _group(value: str, sizes: tuple[int, ...], sep: str) -> str:
    out, i = [], 0
    for size in sizes:
        out.append(value[i:i + size])
        i += size
    if i < len(value):
        out.append(value[i:])
    return sep.join(out)


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _ascii(name: str) -> str:
    import unicodedata

    return "".join(c for c in unicodedata.normalize("NFKD", name) if c.isascii() and c.isalpha() or c == " ")


def email_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    def local(rng: random.Random, name: str) -> str:
        first, *rest = _ascii(name).lower().split()
        return f"{first}.{rest[-1]}{rng.randrange(100) if rng.random() < 0.5 else ''}"

    domains = ["gmail.com", "outlook.es", "proton.me", "web.de", "acme-corp.com", "correo.gob.es", "uni-bonn.de"]
    return {
        "plain": lambda r, n: f"{local(r, n)}@{r.choice(domains)}",
        "subdomain": lambda r, n: f"{local(r, n)}@mail.{r.choice(['eu', 'us', 'ops'])}.{r.choice(domains)}",
        "dashed_ip_host": lambda r, n: f"ops@{r.randrange(1, 255)}-{r.randrange(256)}-{r.randrange(256)}-"
                                       f"{r.randrange(1, 255)}.{r.choice(['example.org', 'acme-corp.com', 'nip.io'])}",
        "ip_literal": lambda r, n: f"root@[{r.randrange(1, 224)}.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(1, 255)}]",
        "punycode_host": lambda r, n: f"{local(r, n)}@{r.choice(['xn--bcher-kva.de', 'xn--espaa-rta.es', 'xn--80ak6aa92e.com'])}",
        "idn_host": lambda r, n: f"{local(r, n)}@{r.choice(['bücher.de', 'españa.es', 'correo.méxico.mx'])}",
        "plus_addressing": lambda r, n: f"{local(r, n)}+{r.choice(['billing', 'invoices', 'x1'])}@{r.choice(domains)}",
        "quoted_local": lambda r, n: f'"{_ascii(n).lower()}"@{r.choice(domains)}',
        "upper_case": lambda r, n: f"{local(r, n)}@{r.choice(domains)}".upper(),
        "private_host": lambda r, n: f"{local(r, n)}@{r.choice(['mail.corp.local', 'ip-10-0-3-7.ec2.internal', 'intranet.lan'])}",
        "new_gtld": lambda r, n: f"{local(r, n)}@{r.choice(['studio.dev', 'shop.app', 'ana.barcelona'])}",
    }


def _valid_phone(rng: random.Random, region: str, kind: str) -> object:
    import phonenumbers

    example = phonenumbers.example_number_for_type(region, kind_type(kind))
    national = str(example.national_number)
    for _ in range(200):  # keep the leading digits (the range), randomise the rest until phonenumbers agrees
        candidate = national[:3] + _digits(rng, len(national) - 3)
        number = phonenumbers.parse(candidate, region)
        if phonenumbers.is_valid_number(number):
            return number
    return example


def kind_type(kind: str) -> int:
    from phonenumbers import PhoneNumberType

    return PhoneNumberType.MOBILE if kind == "mobile" else PhoneNumberType.FIXED_LINE


def phone_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    import phonenumbers
    from phonenumbers import PhoneNumberFormat as F

    def fmt(region: str, kind: str, style: str) -> Callable[[random.Random, str], str]:
        def make(rng: random.Random, _: str) -> str:
            number = _valid_phone(rng, region, kind)
            if style == "national":
                return phonenumbers.format_number(number, F.NATIONAL)
            text = phonenumbers.format_number(number, F.INTERNATIONAL)
            if style == "e164":
                return phonenumbers.format_number(number, F.E164)
            if style == "00":
                return "00" + text[1:]
            if style == "dashes":
                return text.replace(" ", "-")
            if style == "dots":
                return text[:text.index(" ")] + " " + text[text.index(" ") + 1:].replace(" ", ".")
            return text
        return make

    shapes = {}
    for region in ("US", "GB", "ES", "DE", "FR", "IT", "NL"):
        for style in ("national", "international", "e164", "00", "dashes"):
            shapes[f"{region}_{style}"] = fmt(region, "mobile" if region in ("GB", "ES") else "fixed", style)
    shapes["US_dots"] = lambda r, n: _group(str(_valid_phone(r, "US", "fixed").national_number), (3, 3, 4), ".")
    shapes["ES_pairs"] = lambda r, n: "+34 " + _group(str(_valid_phone(r, "ES", "mobile").national_number), (3, 2, 2, 2), " ")
    return shapes


IBAN_BBAN = {"ES": "20n", "DE": "18n", "FR": "10n11n2n", "GB": "4a14n", "IT": "1a10n12n", "NL": "4a10n"}


def _iban(rng: random.Random, country: str) -> str:
    from stdnum import iban

    bban = ""
    for count, kind in re.findall(r"(\d+)([an])", IBAN_BBAN[country]):
        alphabet = string.ascii_uppercase if kind == "a" else string.digits
        bban += "".join(rng.choice(alphabet) for _ in range(int(count)))
    value = country + iban.calc_check_digits(country + "00" + bban) + bban
    return value if iban.is_valid(value) else _iban(rng, country)


def iban_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    shapes = {}
    for country in IBAN_BBAN:
        shapes[f"{country}_spaces"] = lambda r, n, c=country: _group(_iban(r, c), (4,) * 8, " ")
        shapes[f"{country}_compact"] = lambda r, n, c=country: _iban(r, c)
    shapes["ES_dashes"] = lambda r, n: _group(_iban(r, "ES"), (4,) * 8, "-")
    shapes["DE_dots"] = lambda r, n: _group(_iban(r, "DE"), (4,) * 8, ".")
    shapes["ES_lower"] = lambda r, n: _group(_iban(r, "ES"), (4,) * 8, " ").lower()
    return shapes


def _card(rng: random.Random, prefix: str, length: int) -> str:
    from stdnum import luhn

    prefix += rng.choice("12345") if prefix == "5" else ""
    body = prefix + _digits(rng, length - len(prefix) - 1)
    return body + luhn.calc_check_digit(body)


def card_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    networks = {"visa": ("4", 16), "mastercard": ("5", 16), "mastercard2": ("2221", 16), "discover": ("6011", 16)}
    # a Mastercard starts 51-55 (or 2221-2720): the network digit after the 5 is drawn from 1-5 below
    shapes = {}
    for network, (prefix, length) in networks.items():
        for sep_name, sep in (("spaces", " "), ("dashes", "-"), ("dots", "."), ("none", "")):
            shapes[f"{network}_{sep_name}"] = lambda r, n, p=prefix, n_=length, s=sep: _group(_card(r, p, n_), (4, 4, 4, 4), s)
    shapes["amex_spaces"] = lambda r, n: _group(_card(r, "37", 15), (4, 6, 5), " ")
    shapes["amex_none"] = lambda r, n: _card(r, "34", 15)
    return shapes


def ip_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    def v4(r: random.Random, first: int | None = None) -> str:
        return ".".join(str(x) for x in (first or r.randrange(11, 223), r.randrange(256), r.randrange(256), r.randrange(1, 255)))

    def v6(r: random.Random) -> str:
        return ":".join(f"{r.randrange(65536):x}" for _ in range(8))

    return {
        "v4_public": lambda r, n: v4(r),
        "v4_private": lambda r, n: v4(r, r.choice([10, 192, 172])),
        "v4_with_port": lambda r, n: v4(r) + f":{r.choice([22, 443, 8080])}",
        "v6_full": lambda r, n: v6(r),
        "v6_compressed": lambda r, n: f"2001:db8:{r.randrange(65536):x}::{r.randrange(65536):x}",
        "v4_in_url": lambda r, n: f"http://{v4(r)}/admin",
    }


def _ssn(rng: random.Random) -> str:
    area = rng.choice([a for a in range(1, 900) if a != 666])
    return f"{area:03d}{rng.randrange(1, 100):02d}{rng.randrange(1, 10000):04d}"


def ssn_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    return {
        "valid_dashes": lambda r, n: _group(_ssn(r), (3, 2, 4), "-"),
        "valid_spaces": lambda r, n: _group(_ssn(r), (3, 2, 4), " "),
        "valid_dots": lambda r, n: _group(_ssn(r), (3, 2, 4), "."),
        "valid_compact": lambda r, n: _ssn(r),
        "famous_078-05-1120": lambda r, n: "078-05-1120",
        "famous_219-09-9999": lambda r, n: "219-09-9999",
        "famous_compact": lambda r, n: r.choice(["078051120", "219099999"]),
    }


def dni_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    from stdnum.es import dni

    def make(r: random.Random) -> str:
        body = f"{r.randrange(10**7, 10**8)}"
        return body + dni.calc_check_digit(body)

    return {"compact": lambda r, n: make(r), "dash": lambda r, n: (v := make(r))[:8] + "-" + v[8],
            "dots": lambda r, n: (v := make(r))[:2] + "." + v[2:5] + "." + v[5:8] + "-" + v[8],
            "space": lambda r, n: (v := make(r))[:8] + " " + v[8], "lower_letter": lambda r, n: (v := make(r))[:8] + v[8].lower()}


def nie_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    from stdnum.es import nie

    def make(r: random.Random) -> str:
        body = r.choice("XYZ") + f"{r.randrange(10**6, 10**7)}"
        return body + nie.calc_check_digit(body)

    return {"compact": lambda r, n: make(r), "dashes": lambda r, n: (v := make(r))[0] + "-" + v[1:8] + "-" + v[8],
            "dash_letter": lambda r, n: (v := make(r))[:8] + "-" + v[8], "space": lambda r, n: (v := make(r))[0] + " " + v[1:8] + " " + v[8]}


def account_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    return {"digits_8": lambda r, n: _digits(r, 8), "digits_11": lambda r, n: _digits(r, 11),
            "digits_17": lambda r, n: _digits(r, 17)}


def url_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    def secret(r: random.Random, n: int = 20) -> str:
        return "".join(r.choice(string.ascii_letters + string.digits) for _ in range(n))

    return {
        "user_password": lambda r, n: f"https://{_ascii(n).split()[0].lower()}:{secret(r, 12)}@files.acme-corp.com/inv/{r.randrange(999)}.pdf",
        "access_token": lambda r, n: f"https://api.acme-corp.com/v2/invoices?id={r.randrange(999)}&access_token={secret(r)}",
        "api_key": lambda r, n: f"https://maps.example-api.com/geo?q=madrid&api_key={secret(r, 32)}",
        "git_token": lambda r, n: f"https://ghp_{secret(r, 36)}@github.com/acme/billing.git",
        "signed_url": lambda r, n: f"https://bucket.s3.amazonaws.com/report.pdf?X-Amz-Signature={secret(r, 40).lower()}",
        "ftp_password": lambda r, n: f"ftp://backup:{secret(r, 10)}@ftp.acme-corp.com/",
    }


# private names: cue templates per language ({v} = the name)
NAME_CUES = {
    "en": ["Name: {v}", "My name is {v}", "Dear {v},", "Best regards,\n{v}", "my neighbour {v}", "Contact: {v}",
           "Patient: {v}", "Bill to: {v}", "I'm {v}", "forward this to {v}", "Account holder: {v}", "Tenant: {v}"],
    "es": ["Nombre: {v}", "Me llamo {v}", "Estimado {v},", "Saludos,\n{v}", "mi vecina {v}", "Contacto: {v}",
           "Paciente: {v}", "Titular: {v}", "Soy {v}", "reenvíalo a {v}", "Cliente: {v}", "Inquilino: {v}"],
}


def name_shapes() -> dict[str, Callable[[random.Random, str], str]]:
    return {f"cue_{i}": (lambda r, n, i=i: n) for i in range(len(NAME_CUES["en"]))}


SHAPES: dict[str, Callable[[], dict]] = {
    "EMAIL_ADDRESS": email_shapes, "PHONE_NUMBER": phone_shapes, "IBAN_CODE": iban_shapes, "CREDIT_CARD": card_shapes,
    "IP_ADDRESS": ip_shapes, "US_SSN": ssn_shapes, "ES_NIF": dni_shapes, "ES_NIE": nie_shapes,
    "BANK_ACCOUNT": account_shapes, "URL_CREDENTIALS": url_shapes, "PERSON": name_shapes,
}


# --- contexts ---------------------------------------------------------------------------------------------------


def _phrase(entity: str, shape: str, lang: str, value: str, far: bool) -> str:
    """The value with its label, as written in running text (SSN: the label near or far)."""
    label = LABELS[entity][lang == "es"]
    if entity == "PERSON":
        return NAME_CUES[lang][int(shape.split("_")[1])].format(v=value)
    if entity == "US_SSN" and far:
        return (f"SSN on file for this customer {value}" if lang == "en"
                else f"SSN que consta en el expediente {value}")
    if entity == "URL_CREDENTIALS":
        return f"{label}: {value}"
    return f"{label} {value}" if lang == "en" or entity != "PHONE_NUMBER" else f"{label}: {value}"


def _conversation(p: Plant, rng: random.Random) -> None:
    en = p.lang == "en"
    who = p.name or _person(rng)
    phrase = _phrase(p.entity, p.shape, p.lang, p.value, far=rng.random() < 0.5)
    person = p.entity == "PERSON"
    # the record is about a private person: their name is in it (a planted name too, scored as PERSON)
    intro = (f"Customer record for {who}: " if en else f"Ficha del cliente {who}: ") if not person else ""
    answer_obj = {"invoice_number": f"INV-{rng.randrange(10**5):05d}", FIELD[p.entity]: p.value, "total": 118.4}
    if p.context == "prose":
        user = (f"{intro}{phrase}. Please draft a short reply confirming the details." if en
                else f"{intro}{phrase}. Redacta una respuesta breve confirmando los datos.")
        reply = ("Confirmed: " if en else "Confirmado: ") + p.value + "."
        p.conversation = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    elif p.context == "json_answer":
        user = (f"Extract the fields as JSON.\n\nInvoice {answer_obj['invoice_number']}\n{intro}{phrase}\nTotal: 118.40 EUR"
                if en else f"Extrae los campos en JSON.\n\nFactura {answer_obj['invoice_number']}\n{intro}{phrase}\nTotal: 118,40 EUR")
        p.conversation = [{"role": "user", "content": user},
                          {"role": "assistant", "content": json.dumps(answer_obj, ensure_ascii=rng.random() < 0.5)}]
    elif p.context == "tool_call":
        args = {FIELD[p.entity]: p.value, "customer": who} if not person else {"customer_name": p.value}
        user = (f"{intro}{phrase}. Update the CRM." if en else f"{intro}{phrase}. Actualiza el CRM.")
        p.tools = [{"type": "function", "function": {"name": "update_customer", "parameters": {"type": "object"}}}]
        p.conversation = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "update_customer", "arguments": json.dumps(args)}}]},
            {"role": "tool", "content": json.dumps({"ok": True, "record": args})},
            {"role": "assistant", "content": "Done." if en else "Hecho."}]
    elif p.context == "system_prompt":
        system = (f"You are the support assistant. The account you serve: {intro}{phrase}." if en
                  else f"Eres el asistente de soporte. La cuenta que atiendes: {intro}{phrase}.")
        p.conversation = [{"role": "system", "content": system},
                          {"role": "user", "content": "What's on file for me?" if en else "¿Qué datos tenéis míos?"},
                          {"role": "assistant", "content": ("We have " if en else "Tenemos ") + p.value + "."}]
    elif p.context == "table":
        header = LABELS[p.entity][not en].capitalize()
        name_col = "Name" if en else "Nombre"
        row = f"| {who} | {p.value} |" if not person else f"| {p.value} | {rng.randrange(18, 90)} |"
        head = f"| {name_col} | {header} |" if not person else f"| {name_col} | {'Age' if en else 'Edad'} |"
        user = ("Convert this table to CSV:\n\n" if en else "Convierte esta tabla a CSV:\n\n") + f"{head}\n|---|---|\n{row}"
        csv = f"{who},{p.value}" if not person else f"{p.value},42"
        p.conversation = [{"role": "user", "content": user}, {"role": "assistant", "content": csv}]
    else:  # multi_turn: the value comes in the third user turn and is repeated later
        p.conversation = [
            {"role": "user", "content": "Hi, I need to update my details." if en else "Hola, quiero actualizar mis datos."},
            {"role": "assistant", "content": "Sure, what changed?" if en else "Claro, ¿qué ha cambiado?"},
            {"role": "user", "content": f"{intro}{phrase}" + ("." if not phrase.endswith("\n") else "")},
            {"role": "assistant", "content": ("Thanks. To confirm: " if en else "Gracias. Confirmo: ") + p.value + "?"},
            {"role": "user", "content": "Yes." if en else "Sí."},
            {"role": "assistant", "content": "Updated." if en else "Actualizado."}]


def generate(seed: int = 0, per_shape: int = len(CONTEXTS) * len(LANGS)) -> list[Plant]:
    """Every (class, shape) in every context and language: ~1,400 records, deterministic for a seed."""
    rng = random.Random(seed)
    plants = []
    for entity in sorted(SHAPES):
        for shape, make in SHAPES[entity]().items():
            for k in range(per_shape):
                context, lang = CONTEXTS[k % len(CONTEXTS)], LANGS[(k // len(CONTEXTS)) % len(LANGS)]
                name = _person(rng)
                value = make(rng, name)
                p = Plant(entity, shape, context, lang, value, name if entity == "PERSON" else "")
                if entity != "PERSON":
                    p.name = name
                _conversation(p, rng)
                plants.append(p)
    return plants


# --- scoring ----------------------------------------------------------------------------------------------------


def record_texts(conversation: list[dict]) -> list[str]:
    return [t for m in conversation for t in [m["content"], *(c["function"]["arguments"] for c in m.get("tool_calls") or ())]]


def survives(value: str, texts: list[str], entity: str) -> bool:
    """The value, or its JSON-escaped spelling, is still in a text (names case-insensitively, and each word of
    the name that is more than an initial)."""
    spellings = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    joined = "\n".join(texts)
    if entity == "PERSON":
        folded = joined.casefold()
        return any(s.casefold() in folded for s in spellings)
    return any(s in joined for s in spellings)


def shape_of(value: str) -> str:
    """Digits as 9, letters as a, separators as they are; an IP address only by its version."""
    import ipaddress

    try:
        return f"ipv{ipaddress.ip_address(value).version}"
    except ValueError:
        value = re.sub(r"(?:\d{1,3}\.){3}\d{1,3}", "ipv4", value)
    return re.sub(r"[^\W\d_]", "a", re.sub(r"\d", "9", value)).lower()


def structure_problems(before: list[dict], after: list[dict]) -> list[str]:
    """JSON that was valid must stay valid, with the same keys; identifier values keep their shape."""
    problems = []
    for old, new in zip(record_texts(before), record_texts(after), strict=True):
        try:
            old_obj = json.loads(old)
        except ValueError:
            continue
        try:
            new_obj = json.loads(new)
        except ValueError:
            problems.append("invalid JSON after scrubbing")
            continue
        if isinstance(old_obj, dict) and isinstance(new_obj, dict):
            if set(old_obj) != set(new_obj):
                problems.append("JSON keys changed")
            for key, value in old_obj.items():
                if key in ("email", "url", "customer_name", "customer", "record") or not isinstance(value, str):
                    continue
                if shape_of(value) != shape_of(str(new_obj.get(key))):
                    problems.append(f"{key}: shape changed")
    return problems


@dataclass
class Score:
    total: Counter = field(default_factory=Counter)
    replaced: Counter = field(default_factory=Counter)
    misses: list[tuple[Plant, str]] = field(default_factory=list)
    broken: list[tuple[Plant, str]] = field(default_factory=list)

    def recall(self, key: tuple) -> float:
        return self.replaced[key] / self.total[key] if self.total[key] else 1.0


def score(plants: list[Plant], scrubbed: list[list[dict]]) -> Score:
    s = Score()
    for p, after in zip(plants, scrubbed, strict=True):
        texts = record_texts(after)
        checks = [(p.entity, p.value)] + ([("PERSON", p.name)] if p.entity != "PERSON" and p.name else [])
        for entity, value in checks:
            gone = not survives(value, texts, entity)
            shape = p.shape if entity == p.entity else "record_name"
            for key in ((entity,), (entity, shape), ("context", p.context), ("lang", p.lang)):
                s.total[key] += 1
                s.replaced[key] += gone
            if not gone:
                s.misses.append((p, value))
        s.broken += [(p, problem) for problem in structure_problems(p.conversation, after)]
    return s


def run(seed: int = 0, scrubber: object = None) -> tuple[list[Plant], Score, float]:
    import time

    from reprotune.pii import Scrubber

    plants = generate(seed)
    scrubber = scrubber or Scrubber(seed=0)
    scrubber.scrub([[{"role": "user", "content": "warm up: Contact: Jane Roe"}]])  # model load out of the timing
    started = time.perf_counter()
    scrubbed, _ = scrubber.scrub([p.conversation for p in plants])
    return plants, score(plants, scrubbed), time.perf_counter() - started


def print_report(plants: list[Plant], s: Score, seconds: float, show_misses: int = 20) -> None:
    entities = sorted({k[0] for k in s.total if len(k) == 1 and k[0] not in ("context", "lang")})
    planted = sum(s.total[(e,)] for e in entities)
    print(f"Adversarial planted PII: {len(plants)} records, {planted} planted values "
          f"(incl. the name in each record), scrubbed in {seconds:.1f} s")
    print(f"{'class':16} {'planted':>7} {'replaced':>8} {'recall':>7}  shapes below 100%")
    for e in entities:
        weak = [f"{k[1]} {100 * s.recall(k):.0f}%" for k in sorted(s.total) if len(k) == 2 and k[0] == e and s.recall(k) < 1]
        print(f"{e:16} {s.total[(e,)]:7} {s.replaced[(e,)]:8} {100 * s.recall((e,)):6.1f}%  {', '.join(weak) or '-'}")
    for dim in ("context", "lang"):
        print(f"by {dim}: " + ", ".join(f"{k[1]} {100 * s.recall(k):.1f}%" for k in sorted(s.total) if k[0] == dim and len(k) == 2))
    shapes = sorted({(k[0], k[1]) for k in s.total if len(k) == 2 and k[0] not in ("context", "lang")})
    print(f"shapes: {len(shapes)}; structured answers broken: {len(s.broken)}")
    for p, problem in s.broken[:show_misses]:
        print(f"  BROKEN {p.entity}/{p.shape}/{p.context}/{p.lang}: {problem}")
    for p, value in s.misses[:show_misses]:
        print(f"  MISS {p.entity}/{p.shape}/{p.context}/{p.lang}: {value!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show-misses", type=int, default=20)
    args = parser.parse_args()
    plants, s, seconds = run(args.seed)
    print_report(plants, s, seconds, args.show_misses)


if __name__ == "__main__":
    main()
