"""Same bytes on another maker's CPU: the golden run on this CPU and on an emulated one of the other maker.

Pinning the kernel level (reprotune/kernels.py) fixes which code runs; it does not fix what an instruction whose
result each CPU model defines for itself returns: the approximate reciprocal and reciprocal square root (rcpps,
rsqrtps), which MKL's vector math uses for torch.sqrt. Intel and AMD CPUs answer those differently, and the adapter
bytes followed (an Intel Xeon and an AMD EPYC gave two hashes of one pinned run before the fused optimizer,
docs/reproducibility.md). QEMU's user-mode emulator runs the same binary on an emulated CPU
whose vendor, model and flags it reports (cpuid), and computes such instructions exactly, as no real CPU does:
a run that uses one gives other bytes there. So a run equal natively and emulated uses none on its path, and
MKL's vendor dispatch (an Intel CPU emulated on an AMD host, or the other way) is exercised too.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from .test_repro_golden import child_run

# One optimizer step without warm-up (the golden run's warm-up would run its first step at learning rate 0): every
# kind of op of the golden run (forward, backward, clipping, the AdamW update) runs and moves the adapter. Two rows
# a batch, not the golden four: still padded rows (the masked attention the golden run takes), at half the tokens.
# Under emulation the run took ~3 min on an idle 2-core box at two steps (~5 min at four rows).
STEPS = ("train.max_steps=1", "train.warmup_steps=0", "train.per_device_train_batch_size=2")
# the emulated CPU of the other maker (QEMU's models; both have AVX2 and FMA, the pinned level)
OTHER_MAKER = {"AuthenticAMD": "Haswell-v4", "GenuineIntel": "EPYC-Milan"}


@pytest.mark.slow
def test_a_run_gives_the_same_bytes_on_an_emulated_cpu_of_the_other_maker(tmp_path: Path) -> None:
    if platform.machine() != "x86_64":
        pytest.skip("the emulated CPUs are x86-64 (QEMU's user mode runs this interpreter's own binary)")
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-x86_64 is not installed (apt-get install qemu-user; .ci/run installs it)")
    native = child_run(tmp_path / "native", {}, *STEPS)
    model = OTHER_MAKER.get(native["cpu_vendor"], "Haswell-v4")
    emulated = child_run(tmp_path / "emulated", {}, *STEPS, launcher=(qemu, "-cpu", model))
    # the manifest reads /proc/cpuinfo, which QEMU's user mode leaves the host's; QEMU's own lines show the
    # model was applied (it names the model's features its emulator lacks)
    assert "qemu-x86_64: warning: TCG doesn't support requested feature" in emulated["stderr"], \
        "the run did not go through QEMU's emulated CPU"
    assert emulated["cpu_kernels"] == native["cpu_kernels"]  # the same pinned level on both
    assert native["optim"] == emulated["optim"] == "adamw_torch_fused"
    assert emulated["loss"] == native["loss"], f"per-step loss moved on {model}"
    assert emulated["adapter_sha256"] == native["adapter_sha256"], \
        f"adapter bytes moved on an emulated {model} ({native['cpu']!r} natively)"
