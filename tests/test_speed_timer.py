"""Steady tokens/s: warm-up that spills past the first steps must not reach the reported number."""

from __future__ import annotations

import pytest

from reprotune.speed import steady_rate


def marks_from(step_seconds: list[float], tokens_per_step: int = 17_600) -> list[tuple[int, float, int]]:
    marks, t = [(0, 0.0, 0)], 0.0
    for i, sec in enumerate(step_seconds, start=1):
        t += sec
        marks.append((i, t, i * tokens_per_step))
    return marks


def test_a_settled_run_reports_its_rate() -> None:
    assert steady_rate(marks_from([30.0, 2.0, 1.1, 1.1, 1.1, 1.1])) == pytest.approx(17_600 / 1.1)


def test_warm_up_past_the_first_two_steps_is_left_out() -> None:
    # a fresh host: steps 3 and 4 still compile/autotune (the 11.5k vs 15.0k gap of issue #25)
    marks = marks_from([30.0, 4.0, 2.5, 1.6, 1.1, 1.1, 1.1, 1.1])
    got = steady_rate(marks)
    assert got == pytest.approx(17_600 / 1.1)
    # control: the plain window after the first two steps (the old definition) is pulled down by the slow steps
    (_, t0, n0), (_, t1, n1) = marks[2], marks[-1]
    assert (n1 - n0) / (t1 - t0) < 0.8 * got


def test_never_above_the_median_step() -> None:
    # one unusually fast step is kept, but cannot lift the rate above what most steps ran at
    marks = marks_from([9.0, 9.0, 1.2, 1.2, 1.2, 0.6, 1.2])
    assert steady_rate(marks) <= 17_600 / 1.0


def test_too_few_steps() -> None:
    assert steady_rate(marks_from([5.0, 5.0])) is None
