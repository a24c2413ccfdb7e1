"""reprotune: reproducible LoRA/QLoRA fine-tuning of open LLMs."""

__version__ = "0.1.0"
