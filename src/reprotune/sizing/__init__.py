"""Sizing a run before it starts: what `make plan` reports and what `make train` decides, from shapes alone.

    shape.py        the model's shape (preset or config.json, no weights) and the prepared data's token lengths
    memory.py       the memory model: predicted peak GPU memory by part; the budget a run may take of a card
    throughput.py   the throughput model: tokens/s on the H200 (others scaled), steps and tokens of a run
    fit.py          the candidate settings of a run and the fastest of those that fit
    host.py         host memory as a budget: MemAvailable, hardware.host_memory_budget_gib, hardware.offload_layers
    decide.py       the one decision: a run's settings from the config and a hardware description, with reasons
    preflight.py    make train's check on the GPU it runs on: decide, write outputs/train/plan.json, stop if over
    report.py       the plan (outputs/plan.json and its text): memory, fit table, time and cost, warnings
    calibration.py  the models against H200 measurements (conf/plan/calibration.json) and the throughput fit

No module here imports torch at load time (decide.detect asks torch about the GPU, when called). docs/plan.md
explains the models; the stage that prints a plan is reprotune.plan.
"""
