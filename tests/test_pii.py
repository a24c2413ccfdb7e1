"""PII scrubbing (reprotune.pii) with the real Presidio, phonenumbers, stdnum, Faker and spaCy model:
planted PII of every type disappears, task fields survive, fakes are consistent, valid and seeded."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from stdnum import iban, luhn
from stdnum.es import dni, nie

from reprotune.pii import ENTITIES, Scrubber

PLANTED = {
    "EMAIL_ADDRESS": ["jane.doe@acme-corp.com", "j.garcia+billing@correo.es"],
    "PHONE_NUMBER": ["+44 20 7946 0958", "+34 612 345 678", "(415) 555-2671", "0049 30 901820"],
    "IBAN_CODE": ["ES91 2100 0418 4502 0005 1332", "DE89370400440532013000"],
    "BANK_ACCOUNT": ["40012345678"],
    "CREDIT_CARD": ["4111 1111 1111 1111", "5500-0000-0000-0004"],
    "IP_ADDRESS": ["192.168.10.23", "2001:db8:85a3::8a2e:370:7334"],
    "US_SSN": ["536-22-1234"],
    "ES_NIF": ["12345678Z"],
    "ES_NIE": ["X1234567L"],
    "PERSON": ["John Smith", "María García"],
}
SECRETS = ["s3cr3tPass", "ghp_abcDEF1234567890token", "ghp_AbC123xYz987"]
USER = (
    "INVOICE INV-00123 from Acme Industrial Supplies Ltd, dated 12/03/2024.\n"
    "Contact: John Smith <jane.doe@acme-corp.com>, phone +44 20 7946 0958 or (415) 555-2671.\n"
    "Our Madrid office: María García, j.garcia+billing@correo.es, +34 612 345 678, fax 0049 30 901820.\n"
    "Pay to IBAN ES91 2100 0418 4502 0005 1332 (or DE89370400440532013000), account no. 40012345678.\n"
    "Card on file 4111 1111 1111 1111, backup 5500-0000-0000-0004. Portal login from 192.168.10.23 and "
    "2001:db8:85a3::8a2e:370:7334.\n"
    "Tax ids: SSN 536-22-1234, DNI 12345678Z, NIE X1234567L.\n"
    "Files: https://jsmith:s3cr3tPass@files.acme-corp.com/inv/123.pdf and "
    "https://api.acme-corp.com/v2/invoices?id=123&access_token=ghp_abcDEF1234567890token ; "
    "https://ghp_AbC123xYz987@git.acme-corp.com/billing.git\n"
    "TOTAL DUE: EUR 1.234,56 (VAT 21%: 214,26 EUR). Public docs: https://acme-corp.com/terms"
)
ANSWER = json.dumps({"supplier": "Acme Industrial Supplies Ltd", "invoice_number": "INV-00123",
                     "contact": "John Smith", "email": "jane.doe@acme-corp.com", "iban": "ES91 2100 0418 4502 0005 1332",
                     "date": "2024-03-12", "currency": "EUR", "total": 1234.56, "tax": 214.26}, ensure_ascii=False)


@pytest.fixture(scope="module")
def scrubber() -> Scrubber:
    return Scrubber(seed=0)


@pytest.fixture(scope="module")
def scrubbed(scrubber: Scrubber) -> tuple[list, dict]:
    conversations = [[{"role": "system", "content": "Extract the fields."}, {"role": "user", "content": USER},
                      {"role": "assistant", "content": ANSWER}]]
    out, report = scrubber.scrub(conversations)
    return out, report.as_dict()


def test_no_planted_value_survives(scrubbed: tuple[list, dict]) -> None:
    (conv,), _ = scrubbed
    text = "\n".join(m["content"] for m in conv)
    for entity, values in PLANTED.items():
        for value in values:
            assert value not in text, f"{entity} {value!r} survived"
    for secret in SECRETS:
        assert secret not in text, f"URL secret {secret!r} survived"
    for part in ("7946 0958", "555-2671", "0418 4502", "1111 1111 1111", "X1234567"):
        assert part not in text


def test_task_fields_survive(scrubbed: tuple[list, dict]) -> None:
    (conv,), _ = scrubbed
    user, answer = conv[1]["content"], json.loads(conv[2]["content"])
    for kept in ("INV-00123", "Acme Industrial Supplies Ltd", "12/03/2024", "EUR 1.234,56", "214,26 EUR", "VAT 21%",
                 "https://acme-corp.com/terms", "files.acme-corp.com/inv/123.pdf", "api.acme-corp.com/v2/invoices?id=123"):
        assert kept in user, kept
    assert conv[0]["content"] == "Extract the fields."
    assert (answer["supplier"], answer["invoice_number"], answer["date"], answer["total"], answer["tax"]) == \
        ("Acme Industrial Supplies Ltd", "INV-00123", "2024-03-12", 1234.56, 214.26)


def test_answer_replaced_like_the_text(scrubbed: tuple[list, dict]) -> None:
    """A value in both the invoice and the JSON answer becomes the same fake in both (still extractable)."""
    (conv,), _ = scrubbed
    user, answer = conv[1]["content"], json.loads(conv[2]["content"])
    assert answer["contact"] != "John Smith" and f"Contact: {answer['contact']} <{answer['email']}>" in user
    assert answer["iban"] in user


def test_fakes_keep_the_format(scrubbed: tuple[list, dict]) -> None:
    (conv,), _ = scrubbed
    user = conv[1]["content"]
    cards = re.findall(r"Card on file (\d{4} \d{4} \d{4} \d{4}), backup (\d{4}-\d{4}-\d{4}-\d{4})\.", user)
    assert cards, user
    for card in cards[0]:
        assert luhn.is_valid(card.replace(" ", "").replace("-", ""))
    assert cards[0][0].startswith("4") and cards[0][1].startswith("5")  # still Visa / Mastercard
    ibans = re.findall(r"IBAN (ES\d\d(?: \d{4}){5}) \(or (DE\d{20})\)", user)
    assert ibans, user
    assert all(iban.validate(i, check_country=False) for i in ibans[0])  # ISO 7064 check digits
    ids = re.search(r"SSN (\d{3}-\d{2}-\d{4}), DNI (\d{8}[A-Z]), NIE ([XYZ]\d{7}[A-Z])\.", user)
    assert ids, user
    assert dni.is_valid(ids.group(2)) and nie.is_valid(ids.group(3))
    assert re.search(r"phone \+44 \d{2} \d{4} \d{4} or \(\d{3}\) \d{3}-\d{4}\.", user)
    assert re.search(r"\+34 \d{3} \d{3} \d{3}, fax 0049 \d{2} \d{6}\.", user)
    assert re.search(r"https://[\w.]+:[A-Za-z0-9]{10}@files\.acme-corp\.com/", user)
    assert re.search(r"access_token=[A-Za-z0-9_]{25} ;", user)
    assert re.search(r"login from (\d{1,3}\.){3}\d{1,3} and [0-9a-f:]+\.", user)


def test_report_counts_without_values(scrubbed: tuple[list, dict]) -> None:
    _, report = scrubbed
    assert set(report["entities"]) == set(ENTITIES)
    for entity, values in PLANTED.items():
        assert report["entities"][entity]["values"] == len(values), entity
    assert report["entities"]["URL_CREDENTIALS"]["values"] == 3
    assert report["entities"]["EMAIL_ADDRESS"]["replacements"] == 3  # twice in the text, once in the answer
    dumped = json.dumps(report)
    assert not any(v in dumped for values in PLANTED.values() for v in values)


def test_consistent_across_examples_and_seeded(scrubber: Scrubber) -> None:
    convs = [[{"role": "user", "content": f"Mail {who} at jane.doe@acme-corp.com"}, {"role": "assistant", "content": "ok"}]
             for who in ("her", "the team")]
    out, _ = scrubber.scrub(convs)
    fakes = [re.search(r"at (\S+@\S+)", c[0]["content"]).group(1) for c in out]
    assert fakes[0] == fakes[1] and fakes[0] != "jane.doe@acme-corp.com"
    again, _ = Scrubber(seed=0).scrub(convs)
    other, _ = Scrubber(seed=1).scrub(convs)
    assert again == out
    assert other != out


def test_company_names_are_not_people(scrubber: Scrubber) -> None:
    """The built-in invoices hold supplier names and no personal data: nothing is replaced in them."""
    from reprotune.invoices import SUPPLIERS, generate

    convs = [r["messages"] for r in generate(150, seed=1234)]
    out, report = scrubber.scrub(convs)
    assert out == convs
    assert report.as_dict()["total_replacements"] == 0
    lines = [[{"role": "user", "content": f"Bill from {s}\nTotal: 5 EUR"}, {"role": "assistant", "content": s}]
             for s in SUPPLIERS]
    out, report = scrubber.scrub(lines)
    assert out == lines, report.as_dict()


def test_names_next_to_companies(scrubber: Scrubber) -> None:
    convs = [[{"role": "user", "content": "Grace Hopper and Alan Turing were pioneers. Invoice from Smith & Sons Ltd, "
                                          "attn. Peter Novak. Contact: María García, +34 612 345 678."},
              {"role": "assistant", "content": "ok"}]]
    (conv,), report = scrubber.scrub(convs)
    for name in ("Peter Novak", "María García"):  # private: a contact label, a phone next to it
        assert name not in conv[0]["content"]
    assert conv[0]["content"].startswith("Grace Hopper and Alan Turing were pioneers.")  # public figures stay
    assert "Invoice from Smith & Sons Ltd, attn. " in conv[0]["content"]
    assert report.values["PERSON"] == 2


def test_names_in_prose(scrubber: Scrubber) -> None:
    convs = [[{"role": "user", "content": "Please forward this to Sarah Johnson, and thank Mr. Peter Müller for the "
                                          "quick reply. Dear Laura, the report is attached."},
              {"role": "assistant", "content": "Done."}]]
    (conv,), report = scrubber.scrub(convs)
    for name in ("Sarah Johnson", "Peter Müller", "Laura"):
        assert name not in conv[0]["content"]
    assert "Mr. " in conv[0]["content"] and "Dear " in conv[0]["content"]
    assert report.values["PERSON"] == 3


def test_ascii_escaped_json_answer_is_replaced_too(scrubber: Scrubber) -> None:
    answer = json.dumps({"contact": "María García", "phone": "+34 612 345 678"})  # ensure_ascii: Mar\u00eda
    convs = [[{"role": "user", "content": "Contact María García on +34 612 345 678 about invoice F00123."},
              {"role": "assistant", "content": answer}]]
    (conv,), _ = scrubber.scrub(convs)
    fields = json.loads(conv[1]["content"])
    assert fields["contact"] != "María García" and "Garc" not in conv[1]["content"]
    assert f"Contact {fields['contact']} on {fields['phone']} about invoice F00123." == conv[0]["content"]


def test_a_lone_first_name_is_replaced_only_where_it_was_found(scrubber: Scrubber) -> None:
    convs = [[{"role": "user", "content": "Thanks again, Dear Laura, for the quick reply."}, {"role": "assistant", "content": "ok"}],
             [{"role": "user", "content": "Laura\nOrder 12"}, {"role": "assistant", "content": "Laura"}]]
    out, report = scrubber.scrub(convs)
    assert "Laura" not in out[0][0]["content"]
    assert out[1] == convs[1]  # a line-initial "Laura" is not detected there, and is not rewritten either
    assert report.replacements["PERSON"] == 1


# --- names only where they identify a private person; consistent; numbers that are not phones ---------------


def one(scrubber: Scrubber, *texts: str, trace: list | None = None) -> list[str]:
    """Scrub one conversation of user/assistant turns; the scrubbed texts."""
    conv = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    (out,), _ = scrubber.scrub([conv], trace=trace)
    return [m["content"] for m in out]


@pytest.mark.parametrize("text", [
    "Were you trained by Meta? Or created by Meta?",
    "Leonardo da Vinci painted the Mona Lisa; Leonardo Da Vinci was also an engineer.",
    "Sort these names alphabetically: Taylor Swift, Barack Obama, Serena Williams, Frida Kahlo.",
    "In the story, Harry Potter and Hermione Granger visit Diagon Alley for the Glastonbury Festival.",
    "Write a poem about Amelia Earhart's last flight.",
])
def test_public_figures_companies_and_characters_are_kept(scrubber: Scrubber, text: str) -> None:
    assert one(scrubber, text, text) == [text, text]


def test_private_names_are_replaced_consistently_everywhere_in_the_example(scrubber: Scrubber) -> None:
    prompt = ("My name is Leonardo Rossi and my neighbour Karen Whitfield keeps parking in my spot. "
              "Draft a note to her signed by me.")
    answer = "Dear KAREN WHITFIELD,\n... Thank you, Karen.\n\nBest regards,\nleonardo rossi (Leonardo)"
    trace: list[dict] = []
    new_prompt, new_answer = one(scrubber, prompt, answer, trace=trace)
    for original in ("Leonardo", "Rossi", "Karen", "Whitfield", "KAREN", "leonardo"):
        assert original not in new_prompt + new_answer
    fakes = {t["original"]: t["fake"] for t in trace}
    karen, leonardo = fakes["Karen Whitfield"], fakes["Leonardo Rossi"]
    assert fakes["KAREN WHITFIELD"] == karen.upper() and fakes["leonardo rossi"] == leonardo.lower()
    assert fakes["Karen"] == karen.split()[0] and fakes["Leonardo"] == leonardo.split()[0]
    from reprotune.pii import _gendered_names

    male, female = _gendered_names()
    assert leonardo.split()[0] in male and karen.split()[0] in female  # pronouns still agree
    assert new_prompt.endswith("keeps parking in my spot. Draft a note to her signed by me.")


def test_allow_list_keeps_terms(scrubber: Scrubber) -> None:
    text = "Contact: Jane Roe, jane.roe@acme-mail.org. Dear Acme Support, thanks."
    keep = Scrubber(seed=0, allow=["jane roe"])
    out = one(keep, text)[0]
    assert "Jane Roe" in out and "jane.roe@acme-mail.org" not in out
    assert "Jane Roe" not in one(scrubber, text)[0]


def test_reserved_example_domains_are_not_personal(scrubber: Scrubber) -> None:
    text = "Sign up as johndoe@example.com or test@mail.example; write to boss@acme-corp.com."
    out = one(scrubber, text)[0]
    assert "johndoe@example.com" in out and "test@mail.example" in out and "boss@acme-corp.com" not in out


@pytest.mark.parametrize("text", ["The value is 0.762848570174394 after 10 steps.",
                                  "Windows build 10.0.19041.1234 and order 2125551234 shipped.",
                                  "Version 1.22.333.4444; ratio 3.14159265"])
def test_decimals_versions_and_ids_are_not_phones(scrubber: Scrubber, text: str) -> None:
    assert one(scrubber, text) == [text]


def test_phones_are_still_phones(scrubber: Scrubber) -> None:
    text = "Call me on 2125551234 or 212.555.1234, mobile +44 7911 123456."
    out = one(scrubber, text)[0]
    for number in ("2125551234", "212.555.1234", "+44 7911 123456"):
        assert number not in out


def test_ssn_after_a_label_is_replaced_even_if_never_issued(scrubber: Scrubber) -> None:
    text = "Applicant SSN: 078-05-1120. Social Security Number 219-09-9999."
    out = one(scrubber, text)[0]
    assert "078-05-1120" not in out and "219-09-9999" not in out
    assert re.fullmatch(r"Applicant SSN: \d{3}-\d{2}-\d{4}\. Social Security Number \d{3}-\d{2}-\d{4}\.", out)


def test_tool_call_arguments_are_scrubbed_like_text(scrubber: Scrubber) -> None:
    args = json.dumps({"to": "jane.doe@acme-corp.com", "body": "hi"})
    conv = [{"role": "user", "content": "Email jane.doe@acme-corp.com please"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "send_email", "arguments": args}}]},
            {"role": "tool", "content": "sent"}, {"role": "assistant", "content": "Done."}]
    (out,), _ = scrubber.scrub([conv])
    fake = json.loads(out[1]["tool_calls"][0]["function"]["arguments"])["to"]
    assert fake != "jane.doe@acme-corp.com" and out[0]["content"] == f"Email {fake} please"


# --- #28: the leaks an independent planted corpus found ------------------------------------------------------


@pytest.mark.parametrize("email", ["ops@10-1-2-3.example.org", "ops@192-168-10-23.acme-corp.com",
                                   "admin@ip-10-1-2-3.ec2.internal", "root@[10.1.2.3]", '"jane roe"@acme-corp.com',
                                   "billing@mail.corp.local"])
def test_emails_at_ip_private_or_quoted_hosts_are_replaced(scrubber: Scrubber, email: str) -> None:
    answer = json.dumps({"email": email, "total": 12.5})
    new_user, new_answer = one(scrubber, f"Invoice for Karen Whitfield, email {email}. Total 12.50 USD.", answer)
    assert email not in new_user and email not in new_answer and json.dumps(email)[1:-1] not in new_answer
    assert json.loads(new_answer)["total"] == 12.5 and json.loads(new_answer)["email"] in new_user


@pytest.mark.parametrize("text, ssn", [("Customer Karen Whitfield. SSN on file 078-05-1120.", "078-05-1120"),
                                       ("SSN on file for the tenant: 219 09 9999", "219 09 9999"),
                                       ("Social Security Number (verified) 536221234", "536221234"),
                                       ("número de la seguridad social 536-22-1234", "536-22-1234"),
                                       ("Wallet card sample 078-05-1120 was used by thousands.", "078-05-1120")])
def test_ssn_with_words_after_the_label_or_famous_is_replaced(scrubber: Scrubber, text: str, ssn: str) -> None:
    out = one(scrubber, text)[0]
    assert ssn not in out
    assert re.sub(r"\d", "#", out) == re.sub(r"\d", "#", text)  # same shape: digits for digits


def test_a_number_in_ssn_shape_without_a_label_stays(scrubber: Scrubber) -> None:
    text = "Order 123-45-6789 shipped; part 536221234 in stock."
    assert one(scrubber, text) == [text]


def test_a_full_name_found_once_is_replaced_in_every_example(scrubber: Scrubber) -> None:
    """NER finds a name in one sentence and misses it in an almost identical one: the name still goes."""
    convs = [[{"role": "user", "content": f"Invoice INV-{i:04d} for Karen Whitfield, card 4111 1111 1111 1111."},
              {"role": "assistant", "content": json.dumps({"invoice_number": f"INV-{i:04d}"})}] for i in range(12)]
    out, _ = scrubber.scrub(convs)
    assert not any("Whitfield" in m["content"] for conv in out for m in conv)


# --- #28: a fixed sample of the adversarial benchmark (bench/pii_planted.py) in the fast lane ----------------


def bench_planted() -> Any:
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    return importlib.import_module("pii_planted")


def planted_sample(step: int = 5) -> list:
    """Every step-th record of the benchmark (seed 0): every class, most shapes, every context and language."""
    return bench_planted().generate(seed=0)[::step]


@pytest.mark.slow  # full lane: scrubs the planted benchmark sample
def test_benchmark_sample_structured_identifiers_all_replaced(scrubber: Scrubber) -> None:
    bench = bench_planted()
    full = bench.generate(seed=0)
    assert len(full) >= 1000 and [p.conversation for p in full] == [p.conversation for p in bench.generate(seed=0)]
    assert {(p.context, p.lang) for p in full} == {(c, lang) for c in bench.CONTEXTS for lang in bench.LANGS}
    plants = full[::5]
    STRUCTURED, score = bench.STRUCTURED, bench.score
    scrubbed, _ = scrubber.scrub([p.conversation for p in plants])
    s = score(plants, scrubbed)
    assert {p.entity for p in plants} >= set(STRUCTURED)
    for entity in STRUCTURED:
        assert s.recall((entity,)) == 1.0, [(p.shape, p.context, v) for p, v in s.misses if v == p.value and p.entity == entity]
    assert s.recall(("PERSON",)) >= 0.95, s.misses
    assert s.broken == []  # every JSON answer and tool call still parses, identifiers keep their shape


def test_no_planted_value_in_any_prepared_file(tmp_path) -> None:
    """A real prepare run (default scrubbing) on the sample, with invalid records skipped into rejected.jsonl:
    no original value in any byte of any file under data/prepared/ (splits, reports, rejected, plot)."""
    from reprotune.config import compose
    from reprotune.prepare import prepare
    from tests.conftest import write_jsonl

    plants = planted_sample(step=7)
    rows = [{"messages": p.conversation, **({"tools": p.tools} if p.tools else {})} for p in plants]
    # invalid records holding PII too: their rejection reason must not quote it
    bad = [{"messages": [{"role": "bot", "content": p.conversation[0]["content"]}]} for p in plants[:20]]
    bad += [{"messages": p.conversation[:1]} for p in plants[20:40]]
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", rows + bad)
    cfg = compose([f"paths.root={tmp_path}", "model=tiny_random", "data.on_invalid=skip", "data.max_length=2048",
                   "model.chat_template=conf/chat_templates/qwen2_5_tools.jinja",
                   "model.training_chat_template=conf/chat_templates/qwen2_5_tools_training.jinja"])
    prepare(cfg)
    out = tmp_path / "data/prepared"
    files = [f for f in out.rglob("*") if f.is_file()]
    assert {"train.jsonl", "holdout.jsonl", "rejected.jsonl", "report.json", "pii_report.json",
            "lengths.png"} <= {f.name for f in files}
    assert (out / "rejected.jsonl").read_text().count("\n") == 40
    blobs = {f.name: f.read_bytes() for f in files}
    values = {(p.entity, p.value) for p in plants} | {("PERSON", p.name) for p in plants if p.name}
    leaks = []
    for entity, value in sorted(values):
        spellings = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
        for name, blob in blobs.items():
            if any(s.encode() in blob for s in spellings):
                leaks.append((name, entity, value))
    # identifiers: none anywhere; names: the misses the benchmark allows (>= 95% recall), only in the splits
    assert [leak for leak in leaks if leak[1] != "PERSON" and leak[2] not in names_of(plants)] == []
    assert {leak[0] for leak in leaks} <= {"train.jsonl", "holdout.jsonl"}, leaks
    planted_names = [p.name for p in plants if p.name]
    assert sum(name in {leak[2] for leak in leaks} for name in planted_names) <= 0.05 * len(planted_names), leaks


def names_of(plants: list) -> set[str]:
    return {p.name for p in plants if p.name}


# --- #22: texts longer than spaCy's 1,000,000-character limit --------------------------------------------------


def test_text_chunks_overlap_at_word_boundaries() -> None:
    from reprotune.pii import text_chunks

    text = " ".join(f"w{i:05d}" for i in range(50_000))  # 350,000 characters
    chunks = text_chunks(text, size=10_000, overlap=200)
    assert chunks[0][0] == 0 and chunks[-1][0] + len(chunks[-1][1]) == len(text)
    for (start, chunk), (nxt, _) in zip(chunks, chunks[1:], strict=False):
        assert len(chunk) <= 10_000 and text[start:start + len(chunk)] == chunk
        assert nxt < start + len(chunk) - 150  # they overlap
        assert text[nxt - 1] == " " and (start + len(chunk) == len(text) or text[start + len(chunk)] == " ")


@pytest.mark.slow  # a full training or NER pass: the full lane (make test-all, CI); make test stays <= 3 min
def test_names_found_in_a_text_over_the_ner_limit_even_on_a_chunk_edge(scrubber: Scrubber) -> None:
    from reprotune.pii import NER_CHUNK

    filler = "The shipment left the warehouse on time and arrived in good order. "
    head = filler * (NER_CHUNK // len(filler))  # the first name straddles the first chunk's end
    text = (head[:NER_CHUNK - 12] + " Contact: Karen Whitfield, +34 612 345 678. " + filler * 16_000
            + "Best regards,\nLeonardo Rossi")
    assert len(text) > 1_000_000
    (conv,), report = scrubber.scrub([[{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]])
    out = conv[0]["content"]
    assert "Whitfield" not in out and "Rossi" not in out and "612 345 678" not in out
    assert report.values["PERSON"] == 2 and len(out) > 1_000_000


@pytest.mark.parametrize("text, name", [("Saludos,\nLars Whitfield", "Lars Whitfield"),
                                        ("Paciente: Elena Ricci\nMotivo: revisión", "Elena Ricci"),
                                        ("Escribe una nota para mi vecina Lucía Muñoz sobre el ruido.", "Lucía Muñoz"),
                                        ("Estimado Iñaki Mehta, le escribimos por su pedido.", "Iñaki Mehta")])
def test_spanish_cues(scrubber: Scrubber, text: str, name: str) -> None:
    assert name.split()[-1] not in one(scrubber, text)[0]


def test_spanish_public_names_are_kept(scrubber: Scrubber) -> None:
    text = "Gabriel García Márquez escribió Cien años de soledad; Frida Kahlo pintó en Coyoacán."
    assert one(scrubber, text) == [text]
