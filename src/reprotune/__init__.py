"""reprotune: reproducible LoRA/QLoRA fine-tuning of open LLMs."""

import sys as _sys

from reprotune import kernels as _kernels

__version__ = "0.1.0"

# First thing, before any stage imports torch: the CPU kernel level torch, MKL and oneDNN pick when they load
# (hardware.cpu_kernels, read from the command line or the --config-name file; see reprotune/kernels.py).
_kernels.pin_before_torch(_sys.argv[1:])
