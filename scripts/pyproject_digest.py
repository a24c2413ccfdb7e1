"""Print the sha256 of pyproject.toml's dependency declarations (what the lock must agree with)."""

import hashlib
import json
import sys
import tomllib
from pathlib import Path


def dependency_digest(pyproject: Path) -> str:
    project = tomllib.loads(pyproject.read_text())["project"]
    spec = {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    print(dependency_digest(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")))
