"""Fail unless every FROM in the given Dockerfiles names its image by tag and sha256 digest.

    python scripts/check_dockerfile_pins.py docker/Dockerfile

A tag alone moves (axolotlai/axolotl-cloud:main-latest is a different image every week); the digest is the image.
`FROM ${BASE_IMAGE}` is checked through the ARG's default, and `FROM <earlier stage>` needs no pin.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PINNED = re.compile(r"^[a-z0-9][a-z0-9._/:-]*:[A-Za-z0-9._-]+@sha256:[0-9a-f]{64}$")
ARG = re.compile(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", re.IGNORECASE)
FROM = re.compile(r"^FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?\s*$", re.IGNORECASE)
VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with backslash continuations joined and comments dropped."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    return out


def check(path: Path) -> list[str]:
    errors: list[str] = []
    global_args: dict[str, str] = {}
    stages: set[str] = set()
    seen_from = False
    for number, line in logical_lines(path.read_text()):
        if (arg := ARG.match(line)) and not seen_from:
            global_args[arg.group(1)] = arg.group(2) or ""
            continue
        if not (match := FROM.match(line)):
            continue
        seen_from = True
        ref, alias = match.group(1), match.group(2)
        image = VAR.sub(lambda m: global_args.get(m.group(1), ""), ref)
        if image.lower() in stages:
            pass
        elif not image:
            errors.append(f"{path}:{number}: FROM {ref}: the ARG has no default image")
        elif not PINNED.match(image):
            errors.append(f"{path}:{number}: FROM {image}: not pinned by tag and digest (name:tag@sha256:<64 hex>)")
        if alias:
            stages.add(alias.lower())
    if not seen_from:
        errors.append(f"{path}: no FROM instruction")
    return errors


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [Path("docker/Dockerfile")]
    errors = [e for p in paths for e in check(p)]
    for error in errors:
        print(error, file=sys.stderr)
    if not errors:
        print(f"every FROM is pinned by digest: {', '.join(map(str, paths))}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
