"""What `make train` writes besides its manifest: the adapter folder (PEFT's weights, the adapter config named by
the base's stable identity, the tokenizer with the model's own chat template, the model card), swapped in whole, and
the loss curves (loss_curves.json, loss.png)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from omegaconf import DictConfig

from reprotune.config import quantization
from reprotune.errors import needs_bytes, tensor_bytes
from reprotune.io import save_figure, swap_dir, tmp_path
from reprotune.run import Run


# -------------------------------------------------------------------------------------------- loss curves
def loss_curves(log_history: list[dict]) -> dict[str, list]:
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h]
    return {"train": train, "eval": evals}


def mean_loss(curve: list[tuple[int, float]]) -> float:
    """Mean per-step loss from the logged curve (each point averages the steps since the previous one).

    Computed from the log history, which a resumed run restores from its checkpoint, so a resumed run
    reports exactly what an uninterrupted one does (the Trainer's own training_loss only covers the
    steps since the resume).
    """
    total, previous = 0.0, 0
    for step, loss in curve:
        total += loss * (step - previous)
        previous = step
    return total / previous if previous else math.nan


def plot_loss(curves: dict[str, list], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if curves["train"]:
        ax.plot(*zip(*curves["train"], strict=True), label="train loss", marker=".")
    if curves["eval"]:
        ax.plot(*zip(*curves["eval"], strict=True), label="eval loss (validation split of train)", marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (assistant tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def write_curves(trainer, out_dir: Path) -> None:
    """[[step, loss], ...] per split: an output, not a metric (dvc metrics diff compares the final and mean loss)."""
    from reprotune.manifest import write_json

    curves = loss_curves(trainer.state.log_history)
    write_json(out_dir / "loss_curves.json", {"train": curves["train"], "eval": curves["eval"]})
    plot_loss(curves, out_dir / "loss.png")


# ---------------------------------------------------------------------------------------------- adapter
# what data.private means, said on the card itself (privacy by default: true unless the user says otherwise)
PRIVATE_NOTE = ("private=true (the default for any data): this adapter may reproduce its training data, so `make "
                "publish` refuses to upload it or a model merged from it. Set data.private=false only for data you "
                "may share.")
PUBLIC_NOTE = "private=false: the data was declared shareable (data.private=false), so `make publish` may upload it."


def write_model_card(adapter_dir: Path, cfg: DictConfig, metrics: dict) -> None:
    from reprotune.models import base_identity

    base, revision = base_identity(cfg.model)  # never model.path: a host's directory would change the bytes
    text = f"""# reprotune adapter: {cfg.model.name} + {cfg.method.name} on {cfg.data.name}

- Base model: `{cfg.model.name}` ({cfg.model.source}: `{base}`{f' at revision `{revision}`' if revision else ''})
- Method: {cfg.method.name} (r={cfg.method.r}, alpha={cfg.method.lora_alpha}, dora={cfg.method.use_dora}, 4-bit base={bool((quantization(cfg) or {}).get('load_in_4bit'))})
- Data: `{cfg.data.name}` ({metrics['train_examples']} training examples; private={cfg.data.private})
- Steps: {metrics['global_step']}, final train loss {metrics['final_train_loss']:.4f}, seed {cfg.seed}
- Produced by `make train`; the full provenance is in `outputs/train/manifest.json`.

Load with PEFT on the base: `reprotune.models.load_peft_model("outputs/adapter", "<cache>/models")` (adapter_config.json
names the base by a stable identity, not a path: a hub id, `builtin:`, `random_init:` or `local:`).
{PRIVATE_NOTE if cfg.data.private else PUBLIC_NOTE}
"""
    (adapter_dir / "README.md").write_text(text)


def canonicalise_adapter_config(adapter_dir: Path, base: tuple[str, str | None]) -> None:
    """Same run, same bytes on any host: PEFT stores target_modules from a Python set (its order follows the
    per-process string hash seed), so sort it; and it records the base by the path it was loaded from (a
    host's cache location), so name the base by its stable identity instead (reprotune.models.base_identity;
    reprotune.models.resolve_base_identity maps it back to the local directory)."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    for key in ("target_modules", "modules_to_save", "exclude_modules"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    config["base_model_name_or_path"], config["revision"] = base
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_adapter_weights(model, folder: Path, state_dict: dict | None = None) -> None:
    """PEFT's save of the adapter; its size is known before the write, so a full disk says how much it needed."""
    from peft import get_peft_model_state_dict

    # DPO/KTO from an init adapter hold TRL's frozen "ref" copy too: only the trained adapter is the output
    only_trained = {"selected_adapters": ["default"]} if len(getattr(model, "peft_config", {})) > 1 else {}
    with needs_bytes(tensor_bytes(get_peft_model_state_dict(model, state_dict=state_dict).values())):
        model.save_pretrained(folder, **({"state_dict": state_dict} if state_dict is not None else {}), **only_trained)


def save_adapter(trainer, tokenizer, cfg: DictConfig, run: Run, metrics: dict, original_template: str | None,
                 state_dict: dict | None = None) -> Path:
    """Save to a temp dir, then swap it in (the Run's paths.adapter): a crash never leaves a half-written
    outputs/adapter."""
    final = run.path("adapter")
    tmp = tmp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    from reprotune.models import base_identity, save_tokenizer

    save_adapter_weights(trainer.model, tmp, state_dict)
    canonicalise_adapter_config(tmp, base_identity(cfg.model))
    # Ship the model's own chat template (same rendering as the training one, without the loss markers,
    # which inference engines such as llama.cpp do not understand).
    tokenizer.chat_template = original_template
    save_tokenizer(tokenizer, tmp)
    write_model_card(tmp, cfg, metrics)
    swap_dir(tmp, final)
    return final
