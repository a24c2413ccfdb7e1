"""Config composition: every preset composes, CLI overrides land, params.yaml is in sync with conf/."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from reprotune.config import CONF_DIR, compose

MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
METHODS = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))
HARDWARE = sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml"))


def test_presets_exist() -> None:
    assert {"smollm2_135m", "tiny_random", "qwen3_8b", "llama32_1b", "mistral_7b"} <= set(MODELS)
    assert {"lora", "qlora", "dora"} <= set(METHODS)
    assert {"auto", "cpu", "gpu"} <= set(HARDWARE)


@pytest.mark.parametrize(("model", "method", "hardware"), list(itertools.product(MODELS, METHODS, HARDWARE)))
def test_every_preset_composes(model: str, method: str, hardware: str) -> None:
    cfg = compose([f"model={model}", f"method={method}", f"hardware={hardware}"])
    assert cfg.model.name == model
    assert cfg.method.name == method
    assert cfg.train.report_to == "none"  # privacy by default
    # every value resolves (no dangling interpolation)
    from omegaconf import OmegaConf

    OmegaConf.to_container(cfg, resolve=True)
    if method == "qlora":
        assert cfg.method.quantization.load_in_4bit is True
    if method == "dora":
        assert cfg.method.use_dora is True


@pytest.mark.parametrize("model", ["smollm2_135m", "gemma3_270m"])
def test_builtin_models_export_the_quant_their_ladder_gates(model: str) -> None:
    """Both built-in models' default make gguf picks its quant by the parity gate (export.quant=auto over the
    ladder, docs/export.md) on at least 32 holdout prompts: Gemma 3's preset once pinned [Q8_0] and gated on 4."""
    cfg = compose([f"model={model}"])
    assert cfg.export.quant == "auto"
    assert list(cfg.export.ladder) == ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]
    assert cfg.export.parity.examples == "all" or cfg.export.parity.examples >= 32
    assert cfg.export.imatrix.enabled is True


def test_overrides_land() -> None:
    cfg = compose(["method=qlora", "train.max_steps=20", "train.learning_rate=1e-4"])
    assert cfg.train.max_steps == 20
    assert cfg.train.learning_rate == 1e-4
    assert cfg.method.quantization.load_in_4bit


def test_default_is_builtin_model_and_invoice_data() -> None:
    cfg = compose([])
    assert cfg.model.name == "smollm2_135m" and cfg.model.source == "builtin"
    assert cfg.data.name == "invoices"


def test_params_yaml_in_sync_with_conf(tmp_path: Path) -> None:
    """params.yaml and params_pref.yaml (what DVC tracks) must be what 'make params' writes from conf/ now; the
    preference file is the SFT one with objective=dpo (the default of a fresh clone's dvc repro)."""
    from reprotune.config import dump_chain_params

    dump_chain_params([], tmp_path)
    for name in ("params.yaml", "params_pref.yaml"):
        assert yaml.safe_load(Path(name).read_text()) == yaml.safe_load((tmp_path / name).read_text()), \
            f"{name} is stale: run 'make params' and commit it"
    sft, pref = (yaml.safe_load((tmp_path / n).read_text()) for n in ("params.yaml", "params_pref.yaml"))
    assert sft["objective"] == {"name": "sft"} and pref["objective"]["name"] == "dpo"
    assert pref["objective"]["init_adapter"] == "./outputs/adapter"  # the SFT adapter: the chain sft -> dpo
    assert {k: v for k, v in sft.items() if k not in ("objective", "paths")} == {
        k: v for k, v in pref.items() if k not in ("objective", "paths")}
    # the paths differ by the chain's own (conf/objective/paths/preference.yaml) alone
    own = yaml.safe_load((CONF_DIR / "objective/paths/preference.yaml").read_text())
    assert pref["paths"] == {**sft["paths"], **own} and own["adapter"] != sft["paths"]["adapter"]


def test_a_preference_run_writes_both_chains_from_one_set_of_args(tmp_path: Path) -> None:
    """objective.* goes to params_pref.yaml alone; every other override to both (the SFT run it starts from)."""
    from reprotune.config import dump_chain_params

    dump_chain_params(["objective=kto", "objective.beta=0.3", "train.max_steps=7"], tmp_path)
    sft, pref = (yaml.safe_load((tmp_path / n).read_text()) for n in ("params.yaml", "params_pref.yaml"))
    assert sft["objective"] == {"name": "sft"} and sft["train"]["max_steps"] == 7
    assert pref["objective"]["name"] == "kto" and pref["objective"]["beta"] == 0.3 and pref["train"]["max_steps"] == 7


def test_objective_keys_beside_sft_args_go_to_the_default_preference_objective(tmp_path: Path) -> None:
    """make repro ARGS="train.max_steps=3 ++objective.max_steps=2": the SFT chain trains 3 steps, the preference
    chain (DPO, the default) 2; params.yaml has no objective key."""
    from reprotune.config import dump_chain_params

    dump_chain_params(["train.max_steps=3", "++objective.max_steps=2", "++objective.beta=0.2"], tmp_path)
    sft, pref = (yaml.safe_load((tmp_path / n).read_text()) for n in ("params.yaml", "params_pref.yaml"))
    assert sft["objective"] == {"name": "sft"} and sft["train"]["max_steps"] == 3
    assert pref["objective"]["name"] == "dpo" and pref["objective"]["max_steps"] == 2
    assert pref["objective"]["beta"] == 0.2 and pref["train"]["max_steps"] == 3


@pytest.mark.slow  # full lane: renders every model preset's template through its tokenizer
def test_training_template_renders_like_the_model_template() -> None:
    """The {% generation %} markers must not change the text the model is trained on."""
    from transformers import AutoTokenizer

    from reprotune.models import resolve_model_dir

    cfg = compose([])
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache))
    training = (Path(cfg.model.training_chat_template)).read_text()
    conversations = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    ]
    for conv in conversations:
        for gen in (False, True):
            msgs = conv[:-1] if gen else conv
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
                tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, chat_template=training)
    # and the assistant mask covers the reply and its end-of-turn token only
    out = tok.apply_chat_template(conversations[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  chat_template=training)
    ids = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(ids) == "Yo<|im_end|>"
