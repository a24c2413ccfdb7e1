"""DPO on packed pairs (reprotune.preference.packed), checked on the CPU with each family's tiny model in float32:
the packed row (no padding, each pair's prompt computed once) gives every pair the per-token log-probabilities,
the loss, TRL's reward metrics and the LoRA gradients of TRL's own padded batch; and a control shows the check
would catch a leak (a rejected token attending to the chosen answer).

Tolerances as in tests/test_packing.py: log-probabilities 1e-4 absolute (sums of ~100 float32 terms), gradients
relative to the tensor's magnitude."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from reprotune.config import compose
from reprotune.invoices import generate, wrong_extraction
from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
from reprotune.preference import packed
from reprotune.preference.trainers import preference_config, trl_classes
from reprotune.run import resolve
from reprotune.sizing.decide import Hardware, card, decide
from reprotune.train import lora_config

from .families import family_params

N_PAIRS = 4


def pairs() -> list[dict]:
    """Built-in invoice pairs of different lengths (the rejected answer a plausible wrong extraction), one with a
    multi-turn prompt."""
    rows = []
    for i, ex in enumerate(generate(N_PAIRS, seed=5)):
        *prompt, answer = ex["messages"]
        wrong = wrong_extraction(answer["content"], random.Random(i))
        rows.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return rows


def kto_rows() -> list[dict]:
    """The pairs unpaired as KTO's rows (prompt, completion, label), as prepare writes them for objective=kto."""
    return [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
            for pair in pairs() for side in ("chosen", "rejected")]


KTO_ROWS = 5  # an odd micro-batch of unpaired rows: nothing is paired by position


def _trainer(tmp: Path, preset: str, pack: bool, objective: str = "dpo", device: str = "cpu", steps: int = 1,
             overrides: tuple[str, ...] = ()):
    """TRL's trainer for `objective` on the built-in pairs, packed or TRL's padded batch; on the CPU in float32, or
    (tests/test_repro_gpu.py) on CUDA as the GPU fast path decides it."""
    from datasets import Dataset

    from reprotune.sizing.decide import detect

    rows = KTO_ROWS if objective == "kto" else N_PAIRS
    cfg = compose([f"model={preset}", f"hardware={'cpu' if device == 'cpu' else 'gpu'}", f"paths.root={tmp}",
                   f"objective={objective}", f"train.packing={pack}", f"train.per_device_train_batch_size={rows}",
                   f"train.max_steps={steps}", *overrides])
    run = decide(cfg, Hardware("cpu") if device == "cpu" else detect(device), None, None)
    assert run.packing is pack
    if device == "cpu":
        assert run.attn_implementation == (packed.DENSE if pack else None)
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    packed.register_pair_attention(run.attn_implementation)
    model = load_base_model(model_dir, cfg, device, run.dtype, run.attn_implementation)
    trainer_class, _ = trl_classes(objective)
    if pack:
        trainer_class = packed.packed_class(trainer_class, objective)
    data = kto_rows() if objective == "kto" else pairs()
    trainer = trainer_class(model=model, args=preference_config(cfg, run, False, resolve(cfg, "params").objective), processing_class=tokenizer,
                            train_dataset=Dataset.from_list(data), peft_config=lora_config(cfg, tokenizer))
    torch.manual_seed(0)  # LoRA B starts at zero: the policy would equal the reference; perturb it
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return trainer


def loss_and_grads(trainer) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch, False)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards", "logps"))}
    return float(loss), grads, metrics


def assert_same_gradients(grads_p: dict[str, torch.Tensor], grads_u: dict[str, torch.Tensor]) -> None:
    """The same LoRA tensors got gradients, each nonzero and equal to its magnitude's 1e-4."""
    assert grads_p.keys() == grads_u.keys() and len(grads_p) > 0
    for name, g in grads_u.items():
        scale = float(g.abs().max())
        assert scale > 0, name
        assert float((grads_p[name] - g).abs().max()) <= 1e-4 * scale + 1e-7, name


def recorded_calls(trainer, step, record) -> tuple[list, tuple]:
    """step(trainer) with every call of the base model's forward recorded as record(kwargs); (records, result)."""
    calls = []
    model = trainer.model.get_base_model()
    wrapped = model.forward

    def recording(*args, **kwargs):
        calls.append(record(kwargs))
        return wrapped(*args, **kwargs)

    model.forward = recording
    try:
        return calls, step(trainer)
    finally:
        model.forward = wrapped


@pytest.fixture(scope="module", params=family_params(fast=("qwen3",)))
def both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("packed_pairs")
    return _trainer(tmp, request.param, True), _trainer(tmp, request.param, False)


def test_packed_pairs_give_the_padded_batch_loss_metrics_and_gradients(both) -> None:
    packed_trainer, padded_trainer = both
    for (n1, p1), (n2, p2) in zip(packed_trainer.model.named_parameters(), padded_trainer.model.named_parameters(),
                                  strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    batch = next(iter(padded_trainer.get_train_dataloader()))
    padded_tokens = int(batch["input_ids"].numel())
    layout = packed.pack_pairs(batch["input_ids"], batch["attention_mask"],
                               batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100))
    # fewer tokens than the padded rows: no padding, and each prompt once (+ one token per pair)
    assert layout.input_ids.shape[1] < padded_tokens
    assert layout.input_ids.shape[1] == int(batch["attention_mask"].sum()) - sum(
        int(((batch["attention_mask"][i] == 1) & (batch["completion_mask"][i] == 0)).sum()) - 1
        for i in range(N_PAIRS, 2 * N_PAIRS))
    loss_p, grads_p, metrics_p = loss_and_grads(packed_trainer)
    loss_u, grads_u, metrics_u = loss_and_grads(padded_trainer)
    assert loss_p == pytest.approx(loss_u, abs=1e-5)
    assert loss_u > 0.1  # a real loss, not a degenerate zero
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert metrics_p[key] == pytest.approx(metrics_u[key], abs=1e-4), key
    assert_same_gradients(grads_p, grads_u)


def test_a_leak_across_the_pair_would_be_caught(both) -> None:
    """Control: let the rejected answer's queries also see the chosen answer; the log-probabilities move far
    beyond the tolerance above."""
    packed_trainer, _ = both
    batch = next(iter(packed_trainer.get_train_dataloader()))
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    layout = packed.pack_pairs(batch["input_ids"], batch["attention_mask"], labels)
    model = packed_trainer.model.get_base_model()

    def logps(lay: packed.Packed) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=lay.input_ids, position_ids=lay.position_ids, attention_mask=None,
                        shift_labels=lay.shift_labels, fused_lm_head=True, use_cache=False, pair_layout=lay.layout)
        return out.log_probs

    honest = logps(layout)
    # the leak: the first rejected document's keys start at the chosen document's first token instead of its
    # prompt's end (the prompt keys stay, the chosen answer's tokens are added in front of the rejected ones)
    lay = layout.layout
    first_chosen = lay.q_lengths[0]
    prompt_len = lay.k_lengths[1] - (lay.q_lengths[1] - 1)
    k0 = lay.k_lengths[0]
    leaked_keys = torch.cat([lay.k_index[:k0], torch.arange(0, first_chosen), lay.k_index[k0 + prompt_len:]])
    leaked = packed.PairLayout(q_starts=lay.q_starts, q_lengths=lay.q_lengths, k_index=leaked_keys,
                               k_lengths=[k0, first_chosen + lay.k_lengths[1] - prompt_len, *lay.k_lengths[2:]],
                               cu_q=lay.cu_q, cu_k=lay.cu_k, max_q=lay.max_q, max_k=lay.max_k)
    moved = logps(packed.Packed(**{**layout.__dict__, "layout": leaked}))
    assert float((moved - honest).abs().max()) > 1e-2


def test_pairs_whose_prompts_differ_are_two_documents() -> None:
    """Truncation from the end can leave the two rows of a pair with different prompts: then nothing is shared."""
    ids = torch.tensor([[1, 2, 3, 4, 0], [9, 2, 3, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, -100, 4, -100], [-100, -100, -100, 5, 6]])
    lay = packed.pack_pairs(ids, mask, labels)
    assert lay.input_ids.tolist() == [[1, 2, 3, 4, 9, 2, 3, 5, 6]]
    assert lay.layout.q_lengths == lay.layout.k_lengths == [4, 5]
    shared = packed.pack_pairs(torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 5, 6]]), mask, labels)
    assert shared.input_ids.tolist() == [[1, 2, 3, 4, 3, 5, 6]]  # p' = 3 at position 2, then the rejected answer
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4]]
    assert shared.shift_labels.tolist() == [[-100, -100, 4, -100, 5, 6, -100]]
    assert shared.layout.q_lengths == [4, 3] and shared.layout.k_lengths == [4, 5]
    assert shared.layout.k_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 5, 6]


# ---------------------------------------------------------------------------------------------- KTO's packed rows
@pytest.fixture(scope="module", params=family_params(fast=("qwen3",)))
def kto_both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("packed_kto")
    return _trainer(tmp, request.param, True, "kto"), _trainer(tmp, request.param, False, "kto")


@pytest.mark.slow  # full lane: KTO's packed rows against its padded batch (DPO's and ORPO's pairs are the fast lane's)
def test_packed_kto_rows_give_the_padded_batch_loss_kl_metrics_and_gradients(kto_both) -> None:
    """KTO on packed rows (share_prompts=False): every row one document, no padding; the rows, their KL batch and
    the reference forwards all run packed, and give TRL's padded batch's loss, KL, rewards and LoRA gradients."""
    packed_trainer, padded_trainer = kto_both
    batch = next(iter(padded_trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == KTO_ROWS and "KL_input_ids" in batch
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    layout = packed.pack_pairs(batch["input_ids"], batch["attention_mask"], labels, share_prompts=False)
    assert layout.input_ids.shape[1] == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()
    assert layout.layout.q_lengths == layout.layout.k_lengths == batch["attention_mask"].sum(1).tolist()
    calls, (loss_p, grads_p, metrics_p) = recorded_calls(
        packed_trainer, loss_and_grads, lambda kw: kw.get("labels") is not None and kw.get("fused_lm_head"))
    # the rows and the KL batch through the policy, then both through the reference: four packable calls
    assert calls == [True] * 4
    loss_u, grads_u, metrics_u = loss_and_grads(padded_trainer)
    assert loss_p == pytest.approx(loss_u, abs=1e-5) and loss_u > 0.05
    kl_p = packed_trainer._metrics["train"]["kl"][-1]
    assert kl_p == pytest.approx(padded_trainer._metrics["train"]["kl"][-1], abs=1e-4)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= metrics_u.keys()
    for key, value in metrics_u.items():
        assert metrics_p[key] == pytest.approx(value, abs=1e-4), key
    assert_same_gradients(grads_p, grads_u)


# ------------------------------------------------------------------------------------ packed with the batch
def _training_step(trainer, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first step
    loss = trainer.training_step(trainer.model, batch)
    return float(loss), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # full lane: a DPO and a KTO training step through the collator
@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_the_collator_packs_each_batch_on_the_host_and_the_step_packs_nothing_more(
        objective: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed trainer's collator packs the micro-batch (DPO's pairs; KTO's rows and its KL batch) on the host,
    and with the input embedding on the host gathers its rows there too; a training step then packs and gathers
    nothing (every model call, policy and reference, finds its rows by its input_ids: no read-back of the ids
    from the device) and gives the padded trainer's loss and LoRA gradients. Qwen3 (untied embedding)."""
    from reprotune.host_embedding import embedding_on_host

    packed_trainer = _trainer(tmp_path, "tiny_random_qwen3", True, objective)
    padded_trainer = _trainer(tmp_path, "tiny_random_qwen3", False, objective)
    loss_u, grads_u = _training_step(padded_trainer, next(iter(padded_trainer.get_train_dataloader())))
    keys = [k for k in ("packed", "KL_packed") if objective == "kto" or k == "packed"]
    emb = packed_trainer.model.get_input_embeddings()
    with embedding_on_host(packed_trainer.model, active=True):
        batch = next(iter(packed_trainer.get_train_dataloader()))
        for ids_key, packed_key in (("input_ids", "packed"), ("KL_input_ids", "KL_packed"))[:len(keys)]:
            rows = batch[packed_key]
            assert isinstance(rows, packed.Packed) and rows.input_ids.shape[1] < batch[ids_key].numel()
            assert torch.equal(rows.host_rows, emb.weight[rows.host_ids][None])  # the table's rows, gathered
        made = []
        for module, name in ((packed, "pack_pairs"), (__import__("reprotune.host_embedding").host_embedding,
                                                      "gather_rows")):
            original = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: made.append(_n) or _o(*a, **k))
        loss_p, grads_p = _training_step(packed_trainer, batch)
        monkeypatch.undo()
    assert made == []
    assert loss_p == pytest.approx(loss_u, abs=1e-5) and loss_u > 0.05
    assert_same_gradients(grads_p, grads_u)


# ------------------------------------------------------------------------------------------ ORPO's packed pairs
def orpo_loss_and_grads(trainer) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trainer.model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return float(loss), grads, metrics


@pytest.fixture(scope="module", params=family_params(fast=("qwen3",)))
def orpo_both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("packed_orpo")
    return _trainer(tmp, request.param, True, "orpo"), _trainer(tmp, request.param, False, "orpo")


@pytest.mark.slow  # full lane: ORPO's packed pairs against its padded batch (DPO's pairs are the fast lane's)
def test_packed_orpo_pairs_give_the_padded_batch_loss_nll_metrics_and_gradients(orpo_both) -> None:
    """ORPO on packed pairs: one model call through TRL's fused LM head on the packed row (the prompt once, the
    chosen sequence scored whole for the NLL term) gives TRL's padded batch's loss, NLL, odds ratio, rewards,
    mean log-probabilities and LoRA gradients, in float32 on every family. logits/* are the one metric defined
    otherwise (the answer tokens' mean logit, not every padded position's)."""
    packed_trainer, padded_trainer = orpo_both
    assert type(packed_trainer).__name__ == "PackedORPOTrainer"
    calls, (loss_p, grads_p, metrics_p) = recorded_calls(
        packed_trainer, orpo_loss_and_grads, lambda kw: (kw.get("fused_lm_head"), kw.get("pair_layout") is not None))
    assert calls == [(True, True)]  # one packed call, no logits of every position
    loss_u, grads_u, metrics_u = orpo_loss_and_grads(padded_trainer)
    assert loss_p == pytest.approx(loss_u, abs=1e-5) and abs(loss_u) > 0.1
    compared = {k for k in metrics_u if not k.startswith("logits/")}
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/margins", "logps/chosen"} <= compared
    for key in compared:
        assert metrics_p[key] == pytest.approx(metrics_u[key], abs=1e-4), key
    assert_same_gradients(grads_p, grads_u)


def test_the_chosen_sequence_scored_whole_is_orpos_nll_positions() -> None:
    """score_whole_chosen: the chosen document scores every next token (its prompt's too), the rejected one only
    its answer; the prompt is still shared."""
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, -100, 4, -100], [-100, -100, -100, 5, 6]])
    whole = packed.pack_pairs(ids, mask, labels, score_whole_chosen=True)
    assert whole.input_ids.tolist() == [[1, 2, 3, 4, 3, 5, 6]]
    assert whole.shift_labels.tolist() == [[2, 3, 4, -100, 5, 6, -100]]
    assert whole.rows.tolist() == [0, 0, 0, 1, 1] and whole.cols.tolist() == [0, 1, 2, 2, 3]


@pytest.mark.slow  # full lane: an ORPO training step with the table on the host
def test_packed_orpo_with_the_table_on_the_host_gathers_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the input embedding on the host, ORPO's packed call gathers its rows from the ids packed on the host
    (one gather, no read-back of the ids from the device) and gives the same loss. Qwen3 (untied embedding)."""
    from reprotune import host_embedding

    trainer = _trainer(tmp_path, "tiny_random_qwen3", True, "orpo")
    loss, _, _ = orpo_loss_and_grads(trainer)
    gathered = []
    original = host_embedding.gather_rows
    monkeypatch.setattr(host_embedding, "gather_rows", lambda *a: gathered.append(a[1].numel()) or original(*a))
    read_back = []
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, _o=torch.Tensor.to, **k: (
        read_back.append(t.shape) if a[:1] == ("cpu",) and not t.is_floating_point() else None) or _o(t, *a, **k))
    with host_embedding.embedding_on_host(trainer.model, active=True):
        loss_host, _, _ = orpo_loss_and_grads(trainer)
    monkeypatch.undo()
    assert len(gathered) == 1 and gathered[0] > 0 and read_back == []
    assert loss_host == pytest.approx(loss, abs=1e-6)


def test_packed_batches_are_copied_to_the_gpu_without_waiting_for_it(tmp_path: Path) -> None:
    """A packed preference run on CUDA copies its batches non_blocking (from the DataLoader's pinned memory), so the
    collator's host packing runs while the GPU works; a CPU run and unpacked pairs keep the blocking default."""
    def args(*over: str):
        cfg = compose(["model=tiny_random_qwen3", "objective=dpo", f"paths.root={tmp_path}", *over])
        hw = card("H200") if "hardware=gpu" in over else Hardware("cpu")
        # float32: TrainingArguments refuses bf16 on this CPU-only machine; the copies do not depend on it
        return preference_config(cfg, decide(cfg, hw, None, None), False, resolve(cfg, "params").objective)

    gpu = args("hardware=gpu", "hardware.dtype=float32")
    assert gpu.accelerator_config.non_blocking and gpu.dataloader_pin_memory
    assert not args("hardware=gpu", "hardware.dtype=float32", "train.packing=false").accelerator_config.non_blocking
    assert not args("hardware=cpu").accelerator_config.non_blocking
