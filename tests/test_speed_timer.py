"""Steady tokens/s: warm-up that spills past the first steps must not reach the reported number."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reprotune.speed import idle_gaps_report, steady_rate


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


def _event(name: str, device: str, start: float, end: float, thread: int = 1, children: tuple = ()) -> SimpleNamespace:
    event = SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), is_async=False, thread=thread,
                            time_range=SimpleNamespace(start=start, end=end), cpu_parent=None,
                            cpu_children=list(children))
    for child in children:
        child.cpu_parent = event
    return event


def test_idle_gaps_are_summed_by_what_the_host_was_doing() -> None:
    """The profile's idle-gap table (torch.profiler's FunctionEvent fields): a gap while a host op runs goes to
    that op and its innermost child on any thread; a gap between ops to the op last finished."""
    sync = _event("cudaStreamSynchronize", "CPU", 108, 390)
    events = [_event("k1", "CUDA", 0, 100), _event("k2", "CUDA", 102, 110), _event("k3", "CUDA", 400, 500),
              _event("aten::item", "CPU", 106, 395, children=(sync,)),
              _event("aten::mm", "CPU", 450, 480, thread=2), _event("k4", "CUDA", 2500, 2600)]
    report = idle_gaps_report(events).splitlines()
    # 100-102 (under 5 us: left out), 110-400 (290 us, aten::item running), 500-2500 (2 ms, after aten::mm on the other thread)
    assert report[0].startswith("GPU idle gaps >= 5 us: 2.3 ms of 2.6 ms (88.1%)")
    assert report[2].split() == ["2.0", "1", "(python,", "between", "ops)", "|", "after", "aten::mm"]
    assert report[3].split() == ["0.3", "1", "aten::item", "|", "cudaStreamSynchronize"]
    assert len(report) == 4
    assert idle_gaps_report([_event("aten::mm", "CPU", 0, 1)]) == "idle gaps: no device events recorded"
