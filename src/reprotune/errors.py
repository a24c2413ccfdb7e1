"""The one user-facing error, and the one place that turns it into what the user sees.

A stage raises ReprotuneError for anything the user can fix (bad input, a missing earlier output, a check
that refused to ship): one line per problem, `file:line: field: what` where there is a file. Each stage's
command-line entry point runs under `user_errors()`, which prints those lines to stderr, no traceback, and
exits with status 2. Anything else is a bug in reprotune and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_USER_ERROR = 2


class ReprotuneError(Exception):
    """Something the user can fix; `problems` holds one line each (the message is them joined)."""

    def __init__(self, problems: str | list[str], total: int | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        # `total` counts problems past a cap too (a line "... N more problems" stands for the rest)
        self.total = total if total is not None else sum(not p.endswith(" more problems") for p in self.problems)
        super().__init__("\n".join(self.problems))


@contextmanager
def user_errors(summary: str | None = None) -> Iterator[None]:
    """Run a stage's body: a ReprotuneError becomes its lines on stderr (+ `summary`) and exit status 2."""
    try:
        yield
    except ReprotuneError as err:
        print("\n".join(err.problems), file=sys.stderr)
        if summary:
            print(summary.format(count=err.total), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
