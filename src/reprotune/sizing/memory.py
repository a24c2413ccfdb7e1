"""The memory model: predicted peak GPU memory of a run's settings, by part (constants in conf/plan/memory.yaml,
checked against H200 measurements in conf/plan/calibration.json; docs/plan.md explains it), and the budget a run
may take of a card. No torch."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig

from reprotune.config import quantization
from reprotune.flops import checkpointed_layers
from reprotune.run_settings import Settings
from reprotune.sizing.shape import DataShape, Params, Shape, load_table

GIB = 2**30


def micro_batch_tokens(s: Settings, data: DataShape | None) -> int:
    """Tokens in the largest micro-batch: packed rows are filled up to max_length (packed pairs: the largest
    micro-batch of B pairs the run draws, where the data knows it); unpacked batches are padded to their longest
    example, and the data's longest example is in some batch of an epoch (padded preference pairs: 2 rows per
    pair, each as long as the longest sequence)."""
    drawn = drawn_tokens(s, data)
    if drawn:
        return drawn
    return rows(s) * (s.max_length if s.packing else longest_sequence(s, data))


def drawn_tokens(s: Settings, data: DataShape | None) -> int | None:
    """The largest micro-batch of s.batch_size packed pairs the run will draw (reprotune.sizing.draws), else None."""
    if not s.packing or data is None or not data.drawn_batch_tokens:
        return None
    return dict(data.drawn_batch_tokens).get(s.batch_size)


def rows(s: Settings) -> int:
    """Rows of a micro-batch with gradients: batch_size, twice that for padded DPO/ORPO pairs."""
    return s.batch_size * s.sequences


def longest_sequence(s: Settings, data: DataShape | None) -> int:
    """The longest padded row: the data's longest sequence (prepare's report), else max_length."""
    return s.max_length if data is None else min(data.max_tokens, s.max_length)


def no_grad_forwards(s: Settings, data: DataShape | None) -> list[tuple[int, int, int]]:
    """(rows, longest sequence, tokens) of each forward without gradients of a micro-step: the reference's over the
    micro-batch's rows, KTO's KL batch (B rows of a prompt and another example's completion: at most twice the
    longest sequence, and max_length)."""
    if s.reference and drawn_tokens(s, data):  # packed pairs: the drawn micro-batch, a pair at most max_length
        out = [(rows(s), s.max_length, drawn_tokens(s, data))]
    else:
        seq = s.max_length if s.packing else longest_sequence(s, data)
        out = [(rows(s), seq, rows(s) * seq)] if s.reference else []
    if s.kl_rows:
        seq = min(s.max_length, 2 * longest_sequence(s, data))
        out.append((s.batch_size, seq, s.batch_size * seq))
    return out


def input_embedding_bytes(n_params: int, s: Settings) -> float:
    """The input embedding table's bytes (16-bit under QLoRA too: bitsandbytes quantises the layers' linears)."""
    return n_params * (2 if s.load_in_4bit else s.dtype_bytes)


def weight_bytes(p: Params, s: Settings, consts: dict[str, Any]) -> float:
    """The frozen base on the GPU: 16-bit (NF4 for QLoRA's decoder-layer linears; its embeddings stay 16-bit),
    less the input embedding when it stays in host memory."""
    on_host = input_embedding_bytes(p.input_embedding, s) if s.host_embedding else 0
    if not s.load_in_4bit:
        return p.total * s.dtype_bytes - on_host
    w = consts["weights"]
    per_param = w["nf4_bytes_per_param"]
    if s.double_quant:
        per_param += 1 / w["nf4_block"] + 4 / (w["nf4_block"] * w["nf4_double_quant_block"])
    else:
        per_param += 4 / w["nf4_block"]
    return p.layer_linear * per_param + (p.total - p.layer_linear) * 2 - on_host


def adapter_bytes(p: Params, s: Settings, consts: dict[str, Any]) -> float:
    """Trainable parameters + gradients + AdamW states: fp32 for LoRA on a 16-bit base (PEFT's autocast of
    adapter dtypes), bf16 for QLoRA (TRL casts the adapters of a quantised model to bf16)."""
    per = 2 if (s.load_in_4bit and s.dtype_bytes == 2) else 4
    autocast_copy = 2 if per == 4 and s.dtype_bytes == 2 else 0  # bf16 copies of fp32 adapters, kept for backward
    return p.trainable * (per * (2 + consts["optimizer"]["states_per_param"]) + autocast_copy)


def layer_activation_parts(shape: Shape, s: Settings, consts: dict[str, Any]) -> tuple[float, float]:
    """Bytes per token that one decoder layer keeps for backward (no checkpointing): (all but the MLP's
    intermediate-wide tensors, the MLP's intermediate-wide tensors)."""
    a = consts["activations"]
    c = a["input_casts" if s.input_casts and not s.load_in_4bit else "no_input_casts"]
    per_token = c["h_coef"] * shape.hidden + c["kv_coef"] * shape.kv_dim
    wide = c["i_coef"] * shape.intermediate
    if s.liger:
        per_token += a["liger"]["h_delta"] * shape.hidden
        wide += a["liger"]["i_delta"] * shape.intermediate
    if s.mask_repeats_kv:
        per_token += a["gqa_mask_coef"] * (shape.q_dim - shape.kv_dim)
    if shape.qk_norm:  # q_norm/k_norm keep their input (+ an fp32 copy without Liger's RMSNorm)
        qk = a["qk_norm"]
        per_token += (qk["coef"] + (qk["liger_delta"] if s.liger else 0.0)) * (shape.q_dim + shape.kv_dim)
    return per_token * s.dtype_bytes / 2, wide * s.dtype_bytes / 2


def layer_activation_bytes(shape: Shape, s: Settings, consts: dict[str, Any]) -> float:
    """Bytes per token that one decoder layer keeps for backward (no checkpointing)."""
    return sum(layer_activation_parts(shape, s, consts))


def offloaded_layers(shape: Shape, s: Settings) -> int:
    """Decoder layers whose checkpointed input goes to host memory: none without offloading, else
    s.offload_layers of them (0: every layer's)."""
    if not s.offload:
        return 0
    return min(shape.layers, s.offload_layers) if s.offload_layers else shape.layers


def host_offload_bytes(shape: Shape, kept_input: float, consts: dict[str, Any], layers: int | None = None) -> float:
    """Pinned host memory of offloaded activations: each offloaded layer input (default: every layer's; and a few
    tensors around the layers), each a block of torch's caching host allocator, which rounds a request up to a
    power of two; plus what the training process itself holds in host memory."""
    o = consts["activations"]["offload"]
    block = 2 ** math.ceil(math.log2(max(kept_input, 1.0)))
    layers = shape.layers if layers is None else layers
    return (layers + o["host_extra_tensors"]) * block + o["host_process_gib"] * GIB


def mlp_tokens(s: Settings, tokens: int) -> int:
    """Tokens whose MLP intermediates are alive at once: a tile of them with the tiled MLP (tiles cut the
    sequence axis: of the one flattened row of a padding-free packed batch, of every row of a padded one)."""
    if not s.tiled_mlp:
        return tokens
    return min(tokens, s.tiled_mlp if s.packing else s.tiled_mlp * rows(s))


def no_grad_forward_bytes(shape: Shape, s: Settings, n_rows: int, seq: int, consts: dict[str, Any],
                          tokens: int | None = None) -> float:
    """The transient of a forward without gradients over n_rows rows of at most seq tokens, `tokens` in all
    (default n_rows x seq; the reference's, KTO's KL rows): nothing is kept for a backward, so at most one layer's
    tensors are alive at once (with eager attention, its scores: each row's at most seq x its length)."""
    a = consts["activations"]
    ng, tokens = a["no_grad_forward"], n_rows * seq if tokens is None else tokens
    per = ng["h_coef"] * shape.hidden * tokens + ng["i_coef"] * shape.intermediate * mlp_tokens(s, tokens)
    scores = shape.heads * seq * tokens * a["eager_score_bytes"] if s.eager_attention else 0.0
    return per * s.dtype_bytes / 2 + scores


def full_logits_bytes(shape: Shape, s: Settings, tokens: int, consts: dict[str, Any]) -> float:
    """ORPO (TRL 1.16's trl.experimental.orpo): the model returns the logits of every position of the 2B rows, and
    its loss and log-probabilities run on them; the peak holds `copies` logits-sized tensors (the logits, their
    log-softmax, gradients in flight)."""
    lm = consts["lm_head"]
    return lm["full_logits_copies"] * tokens * shape.vocab * s.dtype_bytes + lm["per_valid_token_h_coef"] * shape.hidden * tokens


def dq_split_bytes(shape: Shape, s: Settings, tokens: int) -> float:
    """The extra fp32 dQ accumulators of FlashAttention's deterministic backward, alive during one layer's attention
    backward: torch's flash_api allocates ceil(SMs / (sequences x heads)) of [tokens + 128 x sequences, heads,
    head_dim rounded up to 32] instead of one, where `sequences` is the micro-batch's examples. A long example
    alone in its micro-batch (long context) takes the most: at 96k tokens on an H100's 132 SMs, Qwen3-8B's 32 heads
    give 5 of 1.5 GiB (measured: 22.85 GiB peak against 16.84 with atomic adds, issue #51)."""
    if not s.dq_split_sms:
        return 0.0
    sequences = max(rows(s), -(-tokens // max(s.max_length, 1)))  # the fewest the micro-batch's tokens can be
    splits = -(-s.dq_split_sms // (sequences * shape.heads))
    head_dim = -(-shape.head_dim // 32) * 32
    return (splits - 1) * (tokens + 128 * sequences) * shape.heads * head_dim * 4


def activation_bytes(shape: Shape, s: Settings, tokens: int, consts: dict[str, Any]) -> dict[str, float]:
    """Activations of the largest micro-batch, with and without checkpointing, and the backward transients."""
    a = consts["activations"]
    narrow, wide = layer_activation_parts(shape, s, consts)
    layer = (narrow + wide) * tokens
    # the tiled MLP (reprotune.tiled_mlp) keeps no intermediates: a recomputed layer's live for one tile at a time
    recompute = narrow * tokens + wide * mlp_tokens(s, tokens)
    base = a["base_h_coef"] * shape.hidden * tokens * s.dtype_bytes / 2
    # eager scores: a row's length squared; drawn packed pairs are at most max_length each (sum of squares <= the
    # longest x the sum)
    seq = s.max_length if s.packing else tokens // max(rows(s), 1)
    eager_layer = shape.heads * seq * tokens * a["eager_score_bytes"] if s.eager_attention else 0.0
    backward = (a["backward_h_coef"] * shape.hidden * tokens
                + a["backward_i_coef"] * shape.intermediate * mlp_tokens(s, tokens))
    # a recomputed layer frees its MLP's saved tensors as its backward goes: less of both is alive at once
    recompute_backward = backward - ((a["backward_i_coef"] - a["recomputed_backward_i_coef"]) * shape.intermediate
                                     * mlp_tokens(s, tokens))
    kept_input = a["checkpointed_h_coef"] * shape.hidden * tokens * s.dtype_bytes / 2  # one layer's bf16 input
    # offloaded, the layer inputs wait in host memory; the GPU holds the few in flight (TRL's forward stash, the
    # backward's prefetch) and, offloading only some (issue #48), the inputs of the layers kept
    off = offloaded_layers(shape, s)
    on_gpu = shape.layers - off + min(off, a["offload"]["live_layers"])
    return {
        "no_checkpointing": shape.layers * (layer + eager_layer) + base,
        "checkpointing": on_gpu * kept_input + base,
        "offloaded_host": host_offload_bytes(shape, kept_input, consts, off) if off else 0.0,
        "recompute_layer": recompute + eager_layer,
        "backward_transient": backward * s.dtype_bytes / 2 + dq_split_bytes(shape, s, tokens),
        "recomputed_backward_transient": recompute_backward * s.dtype_bytes / 2 + dq_split_bytes(shape, s, tokens),
    }


def lm_head_bytes(shape: Shape, tokens: int, assistant_share: float, consts: dict[str, Any]) -> float:
    """TRL's fused LM head: logits exist only as (4096 tokens x 32768 vocabulary) tiles of the loss positions."""
    lm = consts["lm_head"]
    valid = max(1, int(tokens * assistant_share))
    tile = min(valid, lm["token_tile"]) * min(shape.vocab, lm["vocab_tile"]) * 2
    return lm["tiles_live"] * tile + lm["per_valid_token_h_coef"] * shape.hidden * valid


def memory(shape: Shape, p: Params, s: Settings, data: DataShape | None,
           consts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted peak of torch.cuda.max_memory_allocated for these settings, by part (bytes and GiB)."""
    consts = consts or load_table("memory.yaml")
    tokens = micro_batch_tokens(s, data)
    share = data.assistant_share if data else 1.0
    act = activation_bytes(shape, s, tokens, consts)
    lm = full_logits_bytes(shape, s, tokens, consts) if s.full_logits else lm_head_bytes(shape, tokens, share, consts)
    dequant = p.largest_linear * 2 * consts["weights"]["dequant_temp_layers"] if s.load_in_4bit else 0.0
    static = weight_bytes(p, s, consts) + adapter_bytes(p, s, consts)
    k = checkpointed_layers(shape.layers, s.ckpt_every) if s.checkpointing else 0
    if k == shape.layers:
        # backward: the loss head first, then one layer at a time is recomputed next to the saved layer inputs
        saved = act["checkpointing"]
        dynamic = saved + max(lm, act["recompute_layer"] + act["recomputed_backward_transient"]) + dequant
    elif k == 0:
        saved = act["no_checkpointing"]
        dynamic = saved + lm + act["backward_transient"] + dequant
    else:  # every n-th layer keeps its input only; a recomputed layer may meet the loss head's buffers
        saved = (k * act["checkpointing"] + (shape.layers - k) * act["no_checkpointing"]) / shape.layers
        dynamic = saved + max(lm, act["recompute_layer"]) + act["backward_transient"] + dequant
    # padded preference pairs: the reference forward (and KTO's KL rows through the reference) run under no_grad
    # after the policy's forward, its activations saved: they add a transient, never saved activations. Without a
    # reference, KTO's KL rows go through the policy (no_grad) before its forward: nothing saved yet.
    # (each forward's largest moment: one decoder layer, or its LM head's tiles)
    no_grad = max([max(no_grad_forward_bytes(shape, s, n, seq, consts, t), lm_head_bytes(shape, t, share, consts))
                   for n, seq, t in no_grad_forwards(s, data)], default=0.0)
    if no_grad:
        dynamic = max(dynamic, (saved if s.reference else 0.0) + no_grad + dequant)
    allocated = static + dynamic
    o = consts["overhead"]
    # offloading's copies back to the GPU are allocated on its own stream, whose cached blocks the compute stream
    # cannot reuse: more reserved per allocated byte, most beside the whole MLP's large intermediates
    ratio = (o["reserved_over_allocated"] if not s.offload else
             o["offloaded_reserved_over_allocated"]["tiled_mlp" if s.tiled_mlp else "whole_mlp"])
    reserved = allocated * ratio
    parts = {"weights": weight_bytes(p, s, consts), "adapter_optimizer_grads": adapter_bytes(p, s, consts),
             "activations_checkpointing": act["checkpointing"] + act["recompute_layer"],
             "activations_no_checkpointing": act["no_checkpointing"],
             "backward_transient": act["backward_transient"] + dequant,
             **({"no_grad_forward_transient": no_grad} if no_grad else {}),
             "logits_loss": lm, "cuda_context": o["cuda_context_gib"] * GIB,
             "allocator_reserve": reserved - allocated}
    return {"tokens_per_micro_batch": tokens, "checkpointing": s.checkpointing, "checkpointed_layers": k,
            "peak_allocated_bytes": allocated, "peak_gib": round(allocated / GIB, 2),
            "reserved_gib": round(reserved / GIB, 2),
            "card_gib": round((reserved + o["cuda_context_gib"] * GIB) / GIB, 2),
            "host_offload_gib": round(act["offloaded_host"] / GIB, 2),
            "offloaded_layers": offloaded_layers(shape, s), "layers": shape.layers,
            "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()}}


def needed_bytes(mem: dict[str, Any], consts: dict[str, Any]) -> float:
    """What a card must have free: reserved peak + CUDA context + margin."""
    return (mem["card_gib"] + consts["overhead"]["margin_gib"]) * GIB


# QLoRA is how a run fits a 24 GB card, so its default plan must: 22 GiB of card (reserved + CUDA context + margin)
# is a peak of ~20 GiB allocated, and leaves 1.5 GiB of an RTX 4090's 23.5 GiB to a desktop or a second process
QLORA_BUDGET_GIB = 22.0


def memory_budget(cfg: DictConfig, free_bytes: float) -> float:
    """hardware.memory_budget_gib (what the run may take of the card: reserved + CUDA context), or auto:
    QLORA_BUDGET_GIB for 4-bit runs, else 90% of the GPU's free memory."""
    budget = cfg.hardware.memory_budget_gib
    if budget is None or budget == "auto":
        return QLORA_BUDGET_GIB * GIB if quantization(cfg) else 0.9 * free_bytes
    return float(budget) * GIB
