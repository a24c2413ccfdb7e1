"""The built-in dataset: extract invoice fields to JSON.

A deterministic generator (same seed -> same bytes, on any host) of short, varied invoices: suppliers
from several countries, dates in several formats, currencies written as codes or symbols, amounts with
thousands separators in both the English and the continental style. The assistant answers with one
JSON object in a fixed key order, which is the "strict output format" job the seeds recommend
fine-tuning for.

    python -m reprotune.invoices --out data/raw/invoices.jsonl --n 600 --seed 1234
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import date, timedelta
from pathlib import Path

from reprotune.io import atomic_write_text, jsonl_text

SYSTEM_PROMPT = (
    "Extract the invoice fields. Answer with one JSON object with the keys supplier, invoice_number, "
    "date (YYYY-MM-DD), currency (ISO 4217), total and tax (numbers), and nothing else."
)
FIELDS = ("supplier", "invoice_number", "date", "currency", "total", "tax")

SUPPLIERS = [
    "Acme Industrial Supplies Ltd", "Nordwind Logistik GmbH", "Soluciones Hidalgo S.L.",
    "Blue Harbor Software Inc.", "Papeterie Durand SARL", "Kowalski & Synowie Sp. z o.o.",
    "Green Valley Farms LLC", "Tecnoprint Italia S.p.A.", "Oakridge Consulting Group",
    "Lisboa Têxteis Lda", "Sakura Components K.K.", "Maple Leaf Office Co.", "Helvetia Präzision AG",
    "Riverside Catering Ltd", "Delta Electrónica S.A.", "Van Dijk Bouwmaterialen B.V.",
    "Northern Lights Media AB", "Atlas Freight Services", "Café Central Distribuciones",
    "Quantum Cloud Hosting Ltd", "Bright Spark Electrical", "Boulangerie Martin", "Ferretería López",
    "Pioneer Lab Equipment Inc.", "Østergaard Design ApS", "Summit Legal Partners LLP",
]
# (code, symbol or None, continental decimal comma?)
CURRENCIES = [("EUR", "€", True), ("USD", "$", False), ("GBP", "£", False), ("CHF", None, False),
              ("JPY", "¥", False), ("SEK", None, True), ("PLN", None, True), ("CAD", None, False)]
TAX_RATES = [0.0, 0.05, 0.07, 0.1, 0.19, 0.2, 0.21, 0.23]
ITEMS = ["consulting hours", "steel brackets", "printer toner", "cloud hosting (monthly)", "catering service",
         "office chairs", "freight charges", "software licence", "laboratory gloves", "legal advice",
         "cement bags", "LED panels", "design work", "translation services", "coffee beans"]


def _format_amount(value: float, continental: bool, decimals: int) -> str:
    text = f"{value:,.{decimals}f}"  # 1,234,567.89
    if continental:  # 1.234.567,89
        text = text.replace(",", "\0").replace(".", ",").replace("\0", ".")
    return text


def _format_date(day: date, style: int) -> str:
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"]
    return [
        day.isoformat(),
        day.strftime("%d/%m/%Y"),
        f"{day.day:02d}-{months[day.month - 1][:3]}-{day.year}",
        f"{day.day} {months[day.month - 1]} {day.year}",
        f"{months[day.month - 1][:3]} {day.day}, {day.year}",
        day.strftime("%d.%m.%Y"),
    ][style]


def _money(rng: random.Random, code: str, symbol: str | None, continental: bool, value: float) -> str:
    decimals = 0 if code == "JPY" else 2
    amount = _format_amount(value, continental, decimals)
    if symbol and rng.random() < 0.5:
        return f"{amount} {symbol}" if continental else f"{symbol}{amount}"
    return f"{code} {amount}" if rng.random() < 0.5 else f"{amount} {code}"


def make_example(rng: random.Random) -> dict:
    """One invoice as a chat example: system instruction, the invoice text, the JSON answer."""
    supplier = rng.choice(SUPPLIERS)
    code, symbol, continental = rng.choice(CURRENCIES)
    rate = rng.choice(TAX_RATES)
    scale = 100 if code == "JPY" else 1
    n_lines = rng.randint(1, 3)
    lines = []
    for _ in range(n_lines):
        qty = rng.randint(1, 40)
        unit = round(rng.uniform(2, 4000 if rng.random() < 0.3 else 400) * scale, 0 if code == "JPY" else 2)
        lines.append((rng.choice(ITEMS), qty, unit))
    net = round(sum(q * u for _, q, u in lines), 2)
    tax = round(net * rate, 0 if code == "JPY" else 2)
    total = round(net + tax, 0 if code == "JPY" else 2)
    issued = date(2023, 1, 1) + timedelta(days=rng.randrange(0, 1000))
    number = rng.choice(["INV-", "F", "No. ", "#", "2024/"]) + str(rng.randint(100, 99999)).zfill(5)

    layout = rng.randrange(3)
    date_text = _format_date(issued, rng.randrange(6))
    items = "\n".join(f"- {name} x{q} @ {_money(rng, code, symbol, continental, u)}" for name, q, u in lines)
    tax_label = f"VAT {round(rate * 100)}%" if rate else "VAT 0% (exempt)"
    if layout == 0:
        text = (f"INVOICE {number}\nFrom: {supplier}\nDate: {date_text}\n{items}\n"
                f"{tax_label}: {_money(rng, code, symbol, continental, tax)}\n"
                f"TOTAL DUE: {_money(rng, code, symbol, continental, total)}")
    elif layout == 1:
        text = (f"{supplier}\nInvoice no. {number}, issued {date_text}\n{items}\n"
                f"Tax: {_money(rng, code, symbol, continental, tax)}\n"
                f"Amount payable: {_money(rng, code, symbol, continental, total)}")
    else:
        text = (f"Bill from {supplier} (ref {number}) dated {date_text}. "
                f"Total {_money(rng, code, symbol, continental, total)} including "
                f"{_money(rng, code, symbol, continental, tax)} tax.\nLines:\n{items}")
    answer = {"supplier": supplier, "invoice_number": number, "date": issued.isoformat(),
              "currency": code, "total": total, "tax": tax}
    return {"messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": text},
        {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)},
    ]}


def _wrong_date(iso: str) -> str:
    """The invoice date in a format the instruction rules out (not YYYY-MM-DD)."""
    day = date.fromisoformat(iso)
    return day.strftime("%d/%m/%Y") if day.day != day.month else day.strftime("%m-%d-%Y")


def _day_month_swapped(iso: str) -> str | None:
    """YYYY-MM-DD read the other way round (2023-11-02 -> 2023-02-11), when that is a date and another one."""
    day = date.fromisoformat(iso)
    return date(day.year, day.day, day.month).isoformat() if day.day <= 12 and day.day != day.month else None


def _day_off_by_one(iso: str) -> str:
    day = date.fromisoformat(iso)
    return day.replace(day=day.day + 1 if day.day < 28 else day.day - 1).isoformat()


def _last_decimal_dropped(value: float) -> float | None:
    """1585.22 -> 1585.2, 1585.2 -> 1585; None for a whole number."""
    text = json.dumps(value)
    if "." not in text or text.endswith(".0"):
        return None
    return json.loads(text[:-1].rstrip("."))


def _thousands_as_decimal_point(value: float) -> float | None:
    """A whole amount's thousands separator read as a decimal point: 12596918 -> 12596.918."""
    if value != int(value) or value < 1000:
        return None
    whole = int(value)
    return json.loads(f"{whole // 1000}.{whole % 1000:03d}")


# plausible extraction mistakes, each one field or two: what a half-trained model gets wrong. The format slips
# come first; the digit slips after them are the ones an SFT adapter of the built-in task still makes on its
# holdout (measured: a dropped last decimal, a thousands separator read as a decimal point, a day or month
# digit; docs/preference.md, "Measured (CPU)")
MISTAKES = ("date_format", "swap_total_tax", "currency_symbol", "number_prefix", "total_as_text",
            "dropped_decimal", "thousands_point", "day_month_swapped", "day_off_by_one")


def wrong_extraction(answer_json: str, rng: random.Random) -> str:
    """A plausible wrong answer for the built-in task (the rejected side of a preference pair): the same JSON
    with one mistake, chosen by `rng` (MISTAKES: a wrong date format, total and tax swapped, a currency symbol
    instead of its ISO code, the invoice number's prefix dropped, the total as a string, an amount's last decimal
    dropped or its thousands read as decimals, a date's day and month swapped or its day one off); always
    differs from the answer."""
    answer = json.loads(answer_json)
    for mistake in rng.sample(MISTAKES, len(MISTAKES)):
        wrong = dict(answer)
        amount = rng.choice(("total", "tax"))
        if mistake == "date_format":
            wrong["date"] = _wrong_date(answer["date"])
        elif mistake == "swap_total_tax" and answer["total"] != answer["tax"]:
            wrong["total"], wrong["tax"] = answer["tax"], answer["total"]
        elif mistake == "currency_symbol":
            symbol = next((s for code, s, _ in CURRENCIES if code == answer["currency"]), None)
            wrong["currency"] = symbol or answer["currency"].lower()
        elif mistake == "number_prefix":
            digits = "".join(ch for ch in answer["invoice_number"] if ch.isdigit())
            wrong["invoice_number"] = digits
        elif mistake == "total_as_text":
            wrong["total"] = f"{answer['total']} {answer['currency']}"
        elif mistake == "dropped_decimal":
            wrong[amount] = _last_decimal_dropped(answer[amount])
        elif mistake == "thousands_point":
            wrong[amount] = _thousands_as_decimal_point(answer[amount])
        elif mistake == "day_month_swapped":
            wrong["date"] = _day_month_swapped(answer["date"])
        elif mistake == "day_off_by_one":
            wrong["date"] = _day_off_by_one(answer["date"])
        if None not in wrong.values() and wrong != answer:
            return json.dumps(wrong, ensure_ascii=False)
    raise ValueError(f"no mistake changes {answer_json}")  # unreachable: the date format always changes


def generate(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(n)]


def write_jsonl(examples: list[dict], out: Path) -> None:
    """Write atomically: a temp file in the same folder, then rename, so a crash leaves the old file."""
    atomic_write_text(out, jsonl_text(examples))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/raw/invoices.jsonl"))
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    write_jsonl(generate(args.n, args.seed), args.out)
    print(f"wrote {args.n} examples to {args.out}")


if __name__ == "__main__":
    main()
