"""Consistent, seeded fakes of the same shape (Luhn-valid cards, valid IBANs, same-country phones...)."""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from reprotune.pii.rules import (
    SECRET_PARAMS,
    TITLES,
    _gendered_names,
)


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
