"""reprotune: reproducible LoRA/QLoRA fine-tuning of open LLMs."""

import logging
import sys as _sys
import warnings

from reprotune import kernels as _kernels

__version__ = "0.1.0"

# First thing, before any stage imports torch: the CPU kernel level torch, MKL and oneDNN pick when they load
# (hardware.cpu_kernels, read from the command line or the --config-name file; see reprotune/kernels.py).
_kernels.pin_before_torch(_sys.argv[1:])


def _quiet_library_advice() -> None:
    """Silence two messages of the locked libraries that a user can do nothing about, and nothing else. Here
    because every stage imports this package before transformers, PEFT or bitsandbytes.

    - bitsandbytes' CPU backend, on a CPU with AVX512-BF16, tries the Hub package `kernels` at import and logs
      "please pip install kernels" when it is missing: it is not in the lock (and would fetch code from the Hub);
      bitsandbytes then uses its own CPU kernels, which is what runs anyway. Its logger only says that.
    - PEFT 0.21 reads the base model's `is_gradient_checkpointing` (peft_model.py, PeftModel.__init__), which
      transformers 5 deprecates with a FutureWarning for `is_activation_checkpointing`: the old name is PEFT's
      call, not ours; the kit itself uses the current names (SFTConfig.activation_checkpointing)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


_quiet_library_advice()
