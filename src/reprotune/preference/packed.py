"""DPO on packed pairs, KTO on packed rows: padding-free, each DPO pair's prompt computed once (issue #26, the GPU
fast path).

TRL 1.16's DPOTrainer pads a micro-batch of B pairs into 2B rows (prompt + chosen, then prompt + rejected, right
padding: its padding-free mode is disabled) and runs the policy and the reference over all of them, so every pair
pays for its prompt twice and for the padding of the longest row. Here the rows TRL's collator built are packed
into one row before the model sees them, pair by pair:

    [prompt, chosen] [p', rejected]        p' = a copy of the prompt's last token, at its position

- the chosen sequence is one causal document;
- the rejected tokens attend to the pair's prompt (its keys and values from the chosen document: the prompt is
  computed once) and causally to themselves: queries [p', rejected] over keys [prompt, rejected], causal from the
  bottom right; p' stands for the prompt's last token, whose next-token distribution predicts the rejected
  answer's first token (in the chosen document that position predicts the chosen answer's first token);
- position ids restart per document as in the padded rows, so every token sees exactly the context it has in
  TRL's padded rows: each answer's per-token log-probabilities, the loss and the gradients are those of the padded
  batch (tests/test_preference_packed.py, in float32 on the CPU), computed on P + C + 1 + R tokens instead of
  2 * max(P + C, P + R) per pair.

KTO's rows are unpaired examples (a prompt and one completion, and its KL batch of mismatched ones): packed
with `share_prompts=False`, each row is its own causal document (no padding; the prompt of each row computed, as
in the padded batch), through the same attention and the same way back to TRL's padded per-token outputs.

A pair whose two rows do not start with the same prompt (truncation from the end) is packed as two independent
documents. The per-token outputs (TRL's fused LM head, called with `shift_labels`) are scattered back into the
padded (2B, T - 1) layout, so TRL's own loss code (every loss_type, ld_alpha, WPO weighting) and metrics run
unchanged: only the model call is replaced, for the policy and the reference alike.

Attention over this layout (`pair_layout` handed to the attention function through the model's kwargs):
`pair_varlen`, torch's FlashAttention varlen kernel (queries and the gathered keys have their own boundaries; its
causal window is bottom-right aligned; deterministic on CUDA in the default and strict modes), and `pair_dense`,
one masked softmax per document in plain torch (the CPU). reprotune.runtime.attention picks one.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from dataclasses import dataclass
from typing import Any

from reprotune.host_embedding import gather_rows, host_table, offer_rows

VARLEN, DENSE = "pair_varlen", "pair_dense"


@dataclass
class PairLayout:
    """Where each document's queries and keys are in the packed row (tensors on the model's device)."""
    q_starts: list[int]          # each document's first query position (documents are contiguous, in order)
    q_lengths: list[int]
    k_index: Any                 # (sum of key lengths,) packed positions of every document's keys, in order
    k_lengths: list[int]
    cu_q: Any                    # (documents + 1,) int32 cumulative query lengths
    cu_k: Any                    # (documents + 1,) int32 cumulative key lengths
    max_q: int
    max_k: int

    def to(self, device: Any, non_blocking: bool = False) -> PairLayout:
        return dataclasses.replace(self, **{f: getattr(self, f).to(device, non_blocking=non_blocking)
                                            for f in ("k_index", "cu_q", "cu_k")})

    def pin_memory(self, *_: Any) -> PairLayout:
        return dataclasses.replace(self, **{f: getattr(self, f).pin_memory() for f in ("k_index", "cu_q", "cu_k")})


@dataclass
class Packed:
    """One micro-batch of padded pairs as one packed row, and the way back to the padded layout."""
    input_ids: Any               # (1, N)
    position_ids: Any            # (1, N)
    shift_labels: Any            # (1, N): the next token each position predicts, -100 where none is scored
    layout: PairLayout
    rows: Any                    # padded row, column (shifted) and packed position of every scored token
    cols: Any
    positions: Any
    shape: tuple[int, int]       # the padded (2B, T - 1) layout of TRL's per-token outputs
    host_ids: Any = None         # (N,) input_ids on the CPU: the host embedding gathers from them, no sync
    host_rows: Any = None        # (1, N, hidden) the host embedding's rows, gathered with the batch (or None)

    DEVICE_FIELDS = ("input_ids", "position_ids", "shift_labels", "rows", "cols", "positions")

    def to(self, device: Any, non_blocking: bool = False) -> Packed:
        """On `device` (accelerate's send_to_device moves a batch's values with .to); host_ids and host_rows stay on
        the host."""
        moved = {f: getattr(self, f).to(device, non_blocking=non_blocking) for f in self.DEVICE_FIELDS}
        return dataclasses.replace(self, layout=self.layout.to(device, non_blocking), **moved)

    def pin_memory(self, *_: Any) -> Packed:
        """Page-locked (the DataLoader's pin_memory), so the copies to the GPU run without a synchronisation."""
        pinned = {f: getattr(self, f).pin_memory() for f in self.DEVICE_FIELDS}
        return dataclasses.replace(self, layout=self.layout.pin_memory(), **pinned)


def _starts(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


@dataclass
class _PackBuilder:
    """The packed row under construction: its tokens, positions and shifted labels, each document's query and key
    spans, and where each scored position of the padded batch lands in it."""
    ids: list[list[int]]
    lab: list[list[int]]
    tokens: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    shift: list[int] = dataclasses.field(default_factory=list)
    q_lengths: list[int] = dataclasses.field(default_factory=list)
    k_index: list[int] = dataclasses.field(default_factory=list)
    k_lengths: list[int] = dataclasses.field(default_factory=list)
    back_rows: list[int] = dataclasses.field(default_factory=list)
    back_cols: list[int] = dataclasses.field(default_factory=list)
    back_pos: list[int] = dataclasses.field(default_factory=list)

    def scored(self, row: int, length: int) -> list[int]:
        """Shifted columns t whose next token row[t + 1] is scored."""
        return [t for t in range(length - 1) if self.lab[row][t + 1] != -100]

    def whole(self, row: int, length: int, score_all: bool = False) -> int:
        """Append row[:length] as one causal document (score_all: every next token scored); its first packed
        position."""
        start = len(self.tokens)
        self.tokens.extend(self.ids[row][:length])
        self.positions.extend(range(length))
        self.shift.extend([*(self.ids if score_all else self.lab)[row][1:length], -100])
        self.q_lengths.append(length)
        self.k_index.extend(range(start, start + length))
        self.k_lengths.append(length)
        for t in (range(length - 1) if score_all else self.scored(row, length)):
            self.back_rows.append(row)
            self.back_cols.append(t)
            self.back_pos.append(start + t)
        return start

    def answer_after_prompt(self, r: int, p: int, len_r: int, start_c: int) -> None:
        """[p', rejected]: p' (the prompt's last token again) predicts the rejected answer's first token; its keys
        are the chosen document's prompt, then itself."""
        start = len(self.tokens)
        answer = len_r - p
        self.tokens.extend(self.ids[r][p - 1:len_r])
        self.positions.extend(range(p - 1, len_r))
        self.shift.extend([*self.lab[r][p:len_r], -100])
        self.q_lengths.append(answer + 1)
        self.k_index.extend([*range(start_c, start_c + p), *range(start + 1, start + 1 + answer)])
        self.k_lengths.append(p + answer)
        for t in self.scored(r, len_r):  # t >= p - 1: the packed position of the token at column t
            self.back_rows.append(r)
            self.back_cols.append(t)
            self.back_pos.append(start + t - (p - 1))

    def add_pair(self, c: int, r: int, len_c: int, len_r: int, score_whole_chosen: bool) -> None:
        """The chosen sequence whole, then the rejected answer after the shared prompt (or whole, when the two
        prompts differ)."""
        ids, lab = self.ids, self.lab
        prompt_c = next((t for t in range(len_c) if lab[c][t] != -100), len_c)
        prompt_r = next((t for t in range(len_r) if lab[r][t] != -100), len_r)
        start_c = self.whole(c, len_c, score_whole_chosen)
        p = prompt_c
        shared = (p == prompt_r and 1 <= p < len_r and len_c >= p and ids[c][:p] == ids[r][:p]
                  and all(v == -100 for v in lab[r][:p]))
        if shared:
            self.answer_after_prompt(r, p, len_r, start_c)
        else:
            self.whole(r, len_r)

    def packed(self, n_rows: int, width: int) -> Packed:
        """The packed batch on the host."""
        import torch

        def tensor(values: list[int], dtype=torch.long) -> Any:
            return torch.tensor(values, dtype=dtype)

        q_lengths, k_lengths = self.q_lengths, self.k_lengths
        cu_q = tensor(_starts(q_lengths) + [sum(q_lengths)], torch.int32)
        cu_k = tensor(_starts(k_lengths) + [sum(k_lengths)], torch.int32)
        layout = PairLayout(q_starts=_starts(q_lengths), q_lengths=q_lengths, k_index=tensor(self.k_index),
                            k_lengths=k_lengths, cu_q=cu_q, cu_k=cu_k, max_q=max(q_lengths), max_k=max(k_lengths))
        host_ids = tensor(self.tokens)
        return Packed(input_ids=host_ids[None], position_ids=tensor(self.positions)[None],
                      shift_labels=tensor(self.shift)[None], layout=layout, rows=tensor(self.back_rows),
                      cols=tensor(self.back_cols), positions=tensor(self.back_pos), shape=(n_rows, width - 1),
                      host_ids=host_ids)


def pack_pairs(input_ids: Any, attention_mask: Any, labels: Any, share_prompts: bool = True,
               score_whole_chosen: bool = False) -> Packed:
    """The packed row of TRL's padded pair batch (rows 0..B-1 chosen, B..2B-1 rejected, right padding; labels =
    input_ids with -100 outside the completion); share_prompts=False: every row its own document (KTO's
    unpaired rows); score_whole_chosen: every next token of the chosen sequence is scored, its prompt's too (ORPO's
    NLL term), the rejected answer's as the labels say."""
    device = input_ids.device
    builder = _PackBuilder(input_ids.tolist(), labels.tolist())
    mask = attention_mask.tolist()
    n_rows, width = len(builder.ids), len(builder.ids[0])
    pairs = n_rows // 2
    if not share_prompts:  # KTO's unpaired rows: each its own document
        for row in range(n_rows):
            builder.whole(row, sum(mask[row]))
    for i in range(pairs if share_prompts else 0):
        builder.add_pair(i, pairs + i, sum(mask[i]), sum(mask[pairs + i]), score_whole_chosen)
    packed = builder.packed(n_rows, width)
    return packed if device.type == "cpu" else packed.to(device)


# -------------------------------------------------------------------------------------------- attention
def _unsupported(name: str, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout:
        raise ValueError(f"{name}: attention dropout is not supported (the packed pairs train without it)")
    if kwargs.get("softcap"):
        raise ValueError(f"{name}: attention logit soft-capping is not supported (use train.packing=false)")


def pair_dense_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                       scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                       pair_layout: PairLayout | None = None, **kwargs: Any) -> tuple[Any, None]:
    """One masked softmax per document (queries over their keys, causal from the bottom right, within the sliding
    window where the layer has one), in float32 like transformers' eager attention: query (1, heads, N, dim),
    key/value (1, kv_heads, N, dim) -> (1, N, heads, dim). A document's keys are in position order, so key index
    distance is position distance."""
    import torch

    if pair_layout is None:
        raise ValueError(f"{DENSE}: called without a pair layout (only reprotune's packed DPO forward uses it)")
    _unsupported(DENSE, dropout, kwargs)
    _, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    out = query.new_zeros(n, heads, dim)
    k_start = 0
    for q0, lq, lk in zip(pair_layout.q_starts, pair_layout.q_lengths, pair_layout.k_lengths, strict=True):
        index = pair_layout.k_index[k_start:k_start + lk]
        k_start += lk
        q = query[0, :, q0:q0 + lq]
        k = key[0][:, index].repeat_interleave(groups, dim=0)
        v = value[0][:, index].repeat_interleave(groups, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        if sliding_window:  # key j within the window of query i: (i + lk - lq) - j < sliding_window
            allowed &= ~torch.ones_like(allowed).tril(diagonal=lk - lq - int(sliding_window))
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[q0:q0 + lq] = torch.matmul(weights, v).transpose(0, 1)
    return out[None], None


def pair_varlen_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                        scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                        pair_layout: PairLayout | None = None, **kwargs: Any) -> tuple[Any, None]:
    """torch's FlashAttention varlen kernel over the layout: the queries in packed order, the keys gathered per
    document; the window (-1, 0) is causal aligned to the bottom right, as the layout needs. Without a layout
    (an unpacked call), reprotune.varlen_attention's padded path."""
    from reprotune.varlen_attention import _kernel, varlen_attention_forward

    if pair_layout is None:
        return varlen_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                        dropout=dropout, sliding_window=sliding_window, **kwargs)
    _unsupported(VARLEN, dropout, kwargs)
    varlen_attn, gqa = _kernel()
    window = (-1, 0) if not sliding_window else (int(sliding_window) - 1, 0)
    _, heads, n, dim = query.shape
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)[pair_layout.k_index]
    v = value[0].transpose(0, 1)[pair_layout.k_index]
    out = varlen_attn(q, k, v, pair_layout.cu_q, pair_layout.cu_k, pair_layout.max_q, pair_layout.max_k,
                      scale=scaling, window_size=window, **gqa)
    return out[None], None


def register() -> None:
    """Make `attn_implementation="pair_varlen"` / `"pair_dense"` known to transformers (no mask is built: the
    layout comes with the call)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN, pair_varlen_forward)
    AttentionInterface.register(DENSE, pair_dense_forward)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
    AttentionMaskInterface.register(DENSE, flash_attention_mask)


def register_pair_attention(attn_implementation: str | None) -> None:
    """register() when the run's attention is one of the pair kernels (before the model loads)."""
    if attn_implementation in (VARLEN, DENSE):
        register()


# ------------------------------------------------------------------------------------------ the model call
def unpack_outputs(packed: Packed, outputs: Any) -> Any:
    """TRL's FusedCausalLMOutput of the packed row, as the padded batch would have given it."""
    import torch

    def back(field: Any) -> Any:
        if field is None:
            return None
        flat = field[0, packed.positions]
        return flat.new_zeros(packed.shape).index_put((packed.rows, packed.cols), flat)

    label_mask = torch.zeros(packed.shape, dtype=torch.bool, device=packed.rows.device)
    label_mask[packed.rows, packed.cols] = True
    return type(outputs)(loss=outputs.loss, log_probs=back(outputs.log_probs), entropy=back(outputs.entropy),
                         log_sum_sq_probs=back(outputs.log_sum_sq_probs), mean_logits=back(outputs.mean_logits),
                         is_top1=back(outputs.is_top1), label_mask=label_mask, aux_loss=outputs.aux_loss)


PACKABLE_KEYS = {"input_ids", "attention_mask", "use_cache", "labels", "fused_lm_head"}
# the padded tensors of TRL 1.16's preference collators that a model call runs on (DPO's pairs and KTO's rows; KTO's
# KL batch), each with the packed row the collator adds for it
BATCH_KEYS = (("input_ids", "attention_mask", "completion_mask", "packed"),
              ("KL_input_ids", "KL_attention_mask", "KL_completion_mask", "KL_packed"))


class PrepackedRows:
    """The packed rows of the micro-batch on the device, by the padded input_ids tensor they were packed from: the
    model calls of a micro-step (policy, reference, KTO's KL batch) find theirs without packing again. An entry
    lives as long as its input_ids tensor (ids are reused, so the tensor itself is checked)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, Packed]] = {}

    def add(self, input_ids: Any, packed: Packed) -> None:
        key = id(input_ids)
        self._by_id[key] = (weakref.ref(input_ids, lambda _: self._by_id.pop(key, None)), packed)

    def get(self, input_ids: Any) -> Packed | None:
        ref, packed = self._by_id.get(id(input_ids), (None, None))
        return packed if ref is not None and ref() is input_ids else None


def packing_collator(collate: Any, share_prompts: bool, model: Any) -> Any:
    """TRL's collator, then each padded batch packed on the host, where it costs no synchronisation and the GPU
    is still busy with the previous micro-step; with the input embedding on the host, its rows gathered too
    (reprotune.host_embedding). The labels are TRL's: input_ids with -100 outside the completion mask."""
    @functools.wraps(collate)
    def collator(examples: list[dict]) -> dict[str, Any]:
        batch = collate(examples)
        table = host_table(model)
        for ids_key, mask_key, completion_key, packed_key in BATCH_KEYS:
            if ids_key not in batch or completion_key not in batch:
                continue
            ids = batch[ids_key]
            labels = ids.masked_fill(batch[completion_key] == 0, -100)
            packed = pack_pairs(ids, batch[mask_key], labels, share_prompts)
            if table is not None:
                packed.host_rows = gather_rows(table, packed.host_ids)[None]
            batch[packed_key] = packed
        return batch

    return collator


def packing_forward(fused_forward: Any, share_prompts: bool = True, prepacked: PrepackedRows | None = None) -> Any:
    """Wrap TRL's fused-LM-head forward: a call on a padded pair batch (share_prompts=False: a batch of unpaired
    rows) runs on its packed row instead (the collator's, from `prepacked`, else packed here)."""

    @functools.wraps(fused_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # a batch handed over whole, not through _prepare_inputs (TRL's precompute_ref_log_probs loop), brings the
        # collator's packed rows, which cannot tell the call's own (KTO's KL call gets the rows'): packed here again
        for _, _, _, packed_key in BATCH_KEYS:
            kwargs.pop(packed_key, None)
        # PEFT hands on its own switches unset (output_attentions=None, ...): anything else set is not a pair batch
        extra = {k for k, v in kwargs.items() if k not in PACKABLE_KEYS and v is not None}
        if args or extra or not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            return fused_forward(*args, **kwargs)
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        packed = prepacked.get(ids) if prepacked is not None else None
        if packed is None:
            import torch

            mask = torch.ones_like(ids) if mask is None else mask
            packed = pack_pairs(ids, mask, kwargs["labels"], share_prompts)
        offer_rows(self.get_input_embeddings(), packed.input_ids, packed.host_rows, packed.host_ids)
        outputs = fused_forward(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                                shift_labels=packed.shift_labels, fused_lm_head=True, use_cache=False,
                                pair_layout=packed.layout)
        return unpack_outputs(packed, outputs)

    return forward


def packed_trainer_class(base: type, share_prompts: bool = True) -> type:
    """A DPOTrainer or KTOTrainer (subclass `base`) whose model calls run on packed rows (see the module
    docstring): DPO's pairs with their prompt shared, KTO's rows (share_prompts=False) each a document. Its
    collator packs each micro-batch on the host (packing_collator); the batch's copies to the GPU do not wait for
    the GPU (pinned memory, non_blocking: trainer_args)."""

    class PackedPreferenceTrainer(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            from accelerate.utils import is_peft_model

            self._prepacked = PrepackedRows()
            target = self.model.get_base_model() if is_peft_model(self.model) else self.model
            target.forward = types.MethodType(packing_forward(target.forward, share_prompts, self._prepacked),
                                              target)
            self.data_collator = packing_collator(self.data_collator, share_prompts, self.model)

        def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
            inputs = super()._prepare_inputs(inputs)
            for ids_key, _, _, packed_key in BATCH_KEYS:
                packed = inputs.pop(packed_key, None)
                if packed is not None:
                    device = inputs[ids_key].device
                    self._prepacked.add(inputs[ids_key], packed if packed.input_ids.device == device
                                        else packed.to(device))
            return inputs

    PackedPreferenceTrainer.__name__ = PackedPreferenceTrainer.__qualname__ = f"Packed{base.__name__}"
    return PackedPreferenceTrainer


def packed_orpo_trainer_class(base: type) -> type:
    """TRL's ORPOTrainer (subclass `base`) on packed pairs: its concatenated_forward runs the pairs as one packed
    row through TRL's fused LM head (added here: TRL's ORPO takes every position's logits) and computes from the
    per-token log-probabilities what TRL computes from the logits: the chosen sequence's NLL (every next token of
    prompt + chosen, averaged over the batch's tokens), each answer's mean log-probability, so the odds-ratio loss,
    rewards and metrics are TRL's own code. logits/chosen and logits/rejected average the answer tokens' mean logit
    (TRL's padded batch averages every position, the prompt's and the padding's too)."""

    class PackedORPOTrainer(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            from accelerate.utils import is_peft_model
            from trl.trainer.utils import add_fused_lm_head

            target = self.model.get_base_model() if is_peft_model(self.model) else self.model
            add_fused_lm_head(target, outputs=("log_probs", "mean_logits"))

        def concatenated_forward(self, model: Any, batch: dict[str, Any]) -> tuple:
            if self.is_encoder_decoder:
                return super().concatenated_forward(model, batch)
            both = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.padding_value,
                                            device=self.accelerator.device)
            n = batch["chosen_labels"].shape[0]
            ids, mask = both["concatenated_input_ids"], both["concatenated_attention_mask"]
            answer = both["concatenated_labels"][:, 1:] != -100  # the shifted positions of each answer's tokens
            packed = pack_pairs(ids, mask, both["concatenated_labels"], share_prompts=True, score_whole_chosen=True)
            offer_rows(model.get_input_embeddings(), packed.input_ids, None, packed.host_ids)  # no second read-back
            extra = {"output_router_logits": True} if self.aux_loss_enabled else {}
            out = unpack_outputs(packed, model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                               attention_mask=None, shift_labels=packed.shift_labels,
                                               fused_lm_head=True, use_cache=False, pair_layout=packed.layout,
                                               **extra))
            logps = out.log_probs
            mean_logps = (logps * answer).sum(-1) / answer.sum(-1)  # TRL's get_batch_logps(average_log_prob=True)
            scored = mask[:n, 1:] == 1  # TRL's chosen NLL: every next token of prompt + chosen
            nll = -(logps[:n] * scored).sum() / scored.sum()
            result = (mean_logps[:n], mean_logps[n:], out.mean_logits[:n][answer[:n]],
                      out.mean_logits[n:][answer[n:]], nll)
            return (*result, out.aux_loss) if self.aux_loss_enabled else result

    PackedORPOTrainer.__name__ = PackedORPOTrainer.__qualname__ = f"Packed{base.__name__}"
    return PackedORPOTrainer


def packed_class(base: type, objective: str) -> type:
    """The packed trainer of `objective` (subclass of TRL's `base`): DPO's pairs sharing their prompt, KTO's rows
    each a document, ORPO's pairs sharing their prompt with the chosen sequence scored whole."""
    if objective == "orpo":
        return packed_orpo_trainer_class(base)
    return packed_trainer_class(base, share_prompts=objective == "dpo")
