"""How good the PII scrubber is on real public datasets plus planted private data.

    python bench/pii_quality.py [--show-unlabelled] [--seed 0]

Reads every file of tests/data/real/ (real public fine-tuning data, sources in its SOURCES.md) with
data.on_invalid=skip, adds planted private records (generated here, deterministic: emails, phones, IBANs,
cards, IPs, national ids, private names in the contexts people write them), scrubs everything with
reprotune.pii.Scrubber and prints:

- per real file: records in, kept, dropped, and why;
- recall of each planted type (the planted value is gone from its record's scrubbed text);
- precision of name replacements: every distinct replaced name, labelled by hand in
  bench/pii_name_labels.json as a private person or not (planted names are private by construction);
  replacements without a label are listed with --show-unlabelled (label them before trusting the number);
- scrubbing time per 1,000 records on this machine;
- the adversarial planted benchmark of bench/pii_planted.py: recall per class, shape, context and language.

Prints to the terminal only (the originals of real data are public, the planted ones fake).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
REAL = REPO / "tests/data/real"
LABELS = REPO / "bench/pii_name_labels.json"

FIRST = ["Priya", "Tomasz", "Aoife", "Mateo", "Ingrid", "Kwame", "Sofia", "Lars", "Amara", "Dmitri", "Chloe",
         "Rahul", "Elena", "Jonas", "Fatima", "Hugo", "Nadia", "Pavel", "Leila", "Oscar", "Hannah", "Emeka",
         "Lucia", "Stefan", "Yara", "Caleb", "Mirela", "Tobias", "Noor", "Felix"]
LAST = ["Raman", "Nowak", "Gallagher", "Herrera", "Lindqvist", "Mensah", "Ricci", "Eriksen", "Okafor", "Volkov",
        "Dubois", "Mehta", "Popescu", "Becker", "Haddad", "Moreau", "Kowalczyk", "Novak", "Farah", "Lindgren",
        "Whitfield", "Adeyemi", "Serrano", "Hofmann", "Nasser", "Brennan", "Ionescu", "Krause", "Aziz", "Wagner"]
# (template, planted types); {name} {email} {phone} {iban} {card} {ip} {ssn} {dni} {nie} are filled in
TEMPLATES = [
    ("Hi, my name is {name} and my order hasn't arrived. You can reach me at {email} or {phone}.",
     ("PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER")),
    ("Please update my payout details. Account holder: {name}\nIBAN: {iban}\nThanks!", ("PERSON", "IBAN_CODE")),
    ("Dear {name},\n\nYour card ending in the number {card} was charged twice. We are refunding it.\n\nSupport",
     ("PERSON", "CREDIT_CARD")),
    ("My neighbour {name} keeps parking in front of my garage. How do I write a polite note?", ("PERSON",)),
    ("Patient: {name}\nSSN: {ssn}\nReason for visit: follow-up on blood pressure.", ("PERSON", "US_SSN")),
    ("Login failures for user {email} from {ip} at 03:12. Is this an attack?", ("EMAIL_ADDRESS", "IP_ADDRESS")),
    ("Rellena el formulario: nombre {name}, DNI {dni}, teléfono {phone}.", ("PERSON", "ES_NIF", "PHONE_NUMBER")),
    ("Tenant: {name}, NIE {nie}. Write a reminder that the rent is due.", ("PERSON", "ES_NIE")),
    ("Can you proofread this? 'Thanks for your help today. Best regards,\n{name}'", ("PERSON",)),
    ("Forward this to {name} ({email}) and copy the team.", ("PERSON", "EMAIL_ADDRESS")),
    ("I'm {name}, I booked room 412 under my card {card}. Can I change the dates?", ("PERSON", "CREDIT_CARD")),
    ("Server {ip} is down again; call me on {phone} when it's back.", ("IP_ADDRESS", "PHONE_NUMBER")),
    ("Write a birthday message for my sister {name}, she turns 30.", ("PERSON",)),
    ("Emergency contact: {name}, phone {phone}", ("PERSON", "PHONE_NUMBER")),
    # no cue at all: the context rules are expected to miss these (they count against recall)
    ("{name} will join the call tomorrow; summarise the agenda for them.", ("PERSON",)),
]
PHONES = ["+1 415 555 2671", "(212) 555-0187", "+44 20 7946 0958", "+34 612 345 678", "+49 30 901820",
          "+33 1 42 68 53 00", "07911 123456", "212.555.0143", "+39 06 6982 1234", "+31 20 794 6000"]
IPS = ["192.168.10.23", "10.4.7.201", "172.16.254.3", "2001:db8:85a3::8a2e:370:7334", "203.0.113.77"]
SSNS = ["536-22-1234", "078-05-1120", "219-09-9999", "457-55-5462"]


def planted(seed: int, n: int = 210) -> list[tuple[list[dict], dict[str, list[str]]]]:
    """n private records (a user turn and a short reply repeating the contact) and what was planted in each."""
    from faker import Faker
    from stdnum import iban, luhn
    from stdnum.es import dni, nie

    rng, fake = random.Random(seed), Faker("en_US")
    fake.seed_instance(seed)
    out = []
    for i in range(n):
        template, types = TEMPLATES[i % len(TEMPLATES)]
        first, last = rng.choice(FIRST), rng.choice(LAST)
        body = "".join(str(rng.randrange(10)) for _ in range(18))
        card_body = rng.choice(["4", "51", "52", "55"])  # Visa or Mastercard: a card number has a network
        card_body += "".join(str(rng.randrange(10)) for _ in range(15 - len(card_body)))
        dni_body = f"{rng.randrange(10**7, 10**8)}"
        nie_body = rng.choice("XYZ") + f"{rng.randrange(10**6, 10**7)}"
        values = {
            "name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower()}{rng.randrange(100)}@{rng.choice(['gmail.com', 'outlook.com', 'proton.me', 'web.de'])}",
            "phone": rng.choice(PHONES),
            "iban": " ".join(_chunks("ES" + iban.calc_check_digits("ES00" + body[:20].ljust(20, "0")) + body[:20].ljust(20, "0"))),
            "card": " ".join(_chunks(card_body + luhn.calc_check_digit(card_body))),
            "ip": rng.choice(IPS),
            "ssn": rng.choice(SSNS),
            "dni": dni_body + dni.calc_check_digit(dni_body),
            "nie": nie_body + nie.calc_check_digit(nie_body),
        }
        text = template.format(**values)
        key = {"PERSON": "name", "EMAIL_ADDRESS": "email", "PHONE_NUMBER": "phone", "IBAN_CODE": "iban",
               "CREDIT_CARD": "card", "IP_ADDRESS": "ip", "US_SSN": "ssn", "ES_NIF": "dni", "ES_NIE": "nie"}
        plants = {t: [values[key[t]]] for t in types}
        reply = f"Noted: {values['name']}." if "PERSON" in types else "Done."
        out.append(([{"role": "user", "content": text}, {"role": "assistant", "content": reply}], plants))
    del fake
    return out


def _chunks(value: str, size: int = 4) -> list[str]:
    return [value[i:i + size] for i in range(0, len(value), size)]


def real_files() -> list[tuple[str, object]]:
    from reprotune.formats import read_file

    return [(p.name, read_file(p, on_invalid="skip")) for p in sorted(REAL.glob("*.json*")) if p != LABELS]


def print_table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show-unlabelled", action="store_true")
    args = parser.parse_args()

    from reprotune.pii import Scrubber

    files = real_files()
    print("Real files (data.on_invalid=skip)")
    rows = []
    for name, result in files:
        reasons = Counter(r["reason"].split(";")[0].split(": ", 1)[-1][:70] for r in result.rejected)
        why = "; ".join(f"{n}x {r}" for r, n in reasons.most_common(2)) or "-"
        rows.append((name, result.format, len(result.records) + len(result.rejected), len(result.records),
                     len(result.rejected), why))
    print_table(rows, ("file", "format", "in", "kept", "dropped", "why dropped"))

    real = [(name, r) for name, result in files for r in result.records]
    plants = planted(args.seed)
    conversations = [r.messages for _, r in real] + [conv for conv, _ in plants]
    origin = [name for name, _ in real] + ["planted"] * len(plants)
    scrubber = Scrubber(seed=0)
    scrubber.scrub([[{"role": "user", "content": "warm up: Contact: Jane Roe"}]])  # model load out of the timing
    trace: list[dict] = []
    started = time.perf_counter()
    scrubbed, report = scrubber.scrub(conversations, trace=trace)
    seconds = time.perf_counter() - started

    # recall: the planted value must be gone from its record (names case-insensitively)
    found, total = Counter(), Counter()
    offset = len(real)
    for i, (_, values) in enumerate(plants):
        text = "\n".join(m["content"] for m in scrubbed[offset + i])
        for entity, vals in values.items():
            for value in vals:
                total[entity] += 1
                gone = value.lower() not in text.lower() if entity == "PERSON" else value not in text
                found[entity] += gone
    print(f"\nRecall of planted private data ({len(plants)} records)")
    print_table([(e, total[e], found[e], f"{100 * found[e] / total[e]:.1f}%") for e in sorted(total)],
                ("entity", "planted", "replaced", "recall"))

    # precision of name replacements: distinct (file, name) pairs
    labels = {k: v for k, v in json.loads(LABELS.read_text()).items() if not k.startswith("_")}
    names = Counter((origin[t["example"]], t["original"].casefold()) for t in trace if t["entity"] == "PERSON")
    planted_names = {}
    for i, (_, values) in enumerate(plants):
        full = values.get("PERSON", [""])[0]
        planted_names[offset + i] = {full.casefold(), *(w.casefold() for w in full.split())}
    # a planted replacement counts as private only if it is the planted name or one of its parts
    exact = Counter(t["original"].casefold() in planted_names[t["example"]] for t in trace
                    if t["entity"] == "PERSON" and t["example"] >= offset)
    verdict: Counter = Counter()
    unlabelled = []
    for (where, name), _ in sorted(names.items()):
        if where == "planted":
            continue
        label = labels.get(f"{where}|{name}")
        if label is None:
            unlabelled.append((where, name))
            verdict["unlabelled"] += 1
        else:
            verdict["private" if label["private"] else "not private"] += 1
    verdict["planted name (private)"] = exact[True]
    verdict["planted record, other text"] = exact[False]
    private = exact[True] + verdict["private"]
    judged = private + exact[False] + verdict["not private"]
    occurrences = sum(1 for t in trace if t["entity"] == "PERSON")
    print(f"\nName replacements: {occurrences} occurrences ({len(names)} distinct (file, name) pairs)")
    print_table([(k, v) for k, v in sorted(verdict.items())], ("label", "occurrences / distinct real names"))
    if judged:
        print(f"precision: {private}/{judged} = {100 * private / judged:.1f}% "
              f"(real data: {verdict['private']} private of {verdict['private'] + verdict['not private']} labelled)")
    kept = [k for k in labels if tuple(k.split("|", 1)) not in names]
    spans = sum(labels[k]["occurrences"] for k in kept)
    print(f"hand-labelled names in real data (none private; public figures, characters, placeholders, a festival): "
          f"{len(kept)} of {len(labels)} left unchanged ({spans} of {sum(v['occurrences'] for v in labels.values())} "
          f"spans the scrubber before #14 replaced)")
    if args.show_unlabelled:
        for where, name in unlabelled:
            context = next(t for t in trace if origin[t["example"]] == where and t["original"].casefold() == name)
            print(f"  {where}|{name}   …{context['before'][-40:]}[{context['original']}]{context['after'][:40]}…")

    print(f"\nScrubbing: {len(conversations)} records in {seconds:.1f} s = {1000 * seconds / len(conversations):.1f} s "
          f"per 1,000 records (this machine, spaCy NER + Presidio; model load excluded); "
          f"{report.as_dict()['total_replacements']} replacements")

    # the adversarial planted corpus (#28): every class x shape x context x language, one value per record
    import pii_planted

    print()
    plants, score, seconds = pii_planted.run(args.seed, scrubber)
    pii_planted.print_report(plants, score, seconds, show_misses=20)


if __name__ == "__main__":
    main()
