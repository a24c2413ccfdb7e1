"""The settings types of a run, as plain values: `Settings` (the memory and throughput models' view of a run) and
`RunSettings` (what `reprotune.sizing.decide` decides once and train, the trainers and `make plan` read). Here,
low in the graph and importing nothing of the project, so that every module that reads a decision (train,
trainer_args, speed, preference.trainers) imports a type, not the planner that makes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Settings:
    method: str
    load_in_4bit: bool
    double_quant: bool
    dora: bool
    r: int
    targets: tuple[str, ...]
    checkpointing: bool
    packing: bool
    batch_size: int
    grad_accum: int
    max_length: int
    eager_attention: bool
    mask_repeats_kv: bool     # SDPA with a mask (and flex attention) repeat K/V to every head
    dtype_bytes: int
    liger: bool = False       # Liger's fused RMSNorm/SwiGLU/RoPE
    input_casts: bool = False  # PEFT's per-adapter input casts (train.py disables them under bf16 autocast)
    ckpt_every: int = 1       # with checkpointing: every n-th decoder layer (transformers' every_n_layers)
    # long context (issue #27), both only with every layer checkpointed:
    offload: bool = False     # TRL's activation offloading: the checkpointed layer inputs wait in pinned host memory
    tiled_mlp: int = 0        # the MLP runs over tiles of this many tokens (reprotune.tiled_mlp); 0: whole
    # with offload: how many layer inputs go to the host, the first layers' (the rest stay on the GPU: the card
    # before the host, issue #48); 0: every layer's
    offload_layers: int = 0
    # padded preference batches (TRL 1.16's DPO/ORPO/KTO collators, issue #26; DPO's packed pairs are packed rows):
    sequences: int = 1        # padded rows per example: 2 for a DPO/ORPO pair (prompt + chosen, prompt + rejected)
    reference: bool = False   # DPO's/KTO's reference forward over the same rows, under no_grad, while the policy's
                              # activations are saved (False: ORPO, or precompute_ref_log_probs)
    kl_rows: bool = False     # KTO's KL batch: B mismatched (prompt, completion) rows through the policy and the
                              # reference, both under no_grad
    full_logits: bool = False  # ORPO: the logits of every position (TRL's ORPO trainer has no fused LM head)
    host_embedding: bool = False  # the frozen input embedding in host memory (reprotune.host_embedding)
    # FlashAttention's deterministic backward (the varlen kernels under repro=default/strict on CUDA) sums dQ in
    # ceil(SMs / (sequences x heads)) fp32 accumulators instead of one: the card's SM count, 0 where it does not run
    dq_split_sms: int = 0


@dataclass(frozen=True)
class RunSettings:
    """How a run trains; `reasons` says why, in the order decided."""
    method: str
    device: str
    dtype: str
    packing: bool
    attn_implementation: str | None  # None: the model's default (SDPA)
    liger: bool
    norm_kernel: str                 # the RMSNorm kernel: liger | torch (torch's fused rms_norm) | eager (the model's)
    fused_lora: bool                 # LoRA's scale and add inside B's matrix product (reprotune.fused_lora)
    optim: str                       # transformers' optimizer name (train.optim, or its CPU replacement)
    dynamic_shapes: bool             # torch.compile traces symbolic sequence lengths from the first call
    activation_checkpointing: bool
    checkpoint_every_n_layers: int   # transformers' every_n_layers: 1 = every decoder layer
    activation_offloading: bool      # TRL's: the checkpointed layer inputs wait in pinned host memory
    offload_layers: int              # with it: the first N decoder layers' inputs offloaded, the rest kept (0: all)
    tiled_mlp_tokens: int            # the MLP over tiles of this many tokens (reprotune.tiled_mlp); 0: whole
    embedding_on_host: bool          # the frozen input embedding stays in host memory (reprotune.host_embedding)
    dataloader_workers: int          # processes that collate the batches (0: the training process)
    per_device_train_batch_size: int
    gradient_accumulation_steps: int  # of one process keeping the global batch alone (the fitted value)
    world_size: int
    strategy: str                    # none | ddp | fsdp2
    process_accumulation: int        # what each of world_size processes accumulates
    global_batch: str
    budget_bytes: float | None       # what the run may take of the GPU (None: no GPU)
    host_budget_bytes: float | None  # what offloading may take of host memory (None: not checked)
    planned: Settings | None         # the memory model's view of this run (None: shape unknown)
    predicted: dict[str, Any] | None  # its predicted memory on this hardware (CUDA only)
    fits: bool                       # the predicted need fits the free memory (always true off CUDA)
    fallback: Settings | None        # what would fit this hardware when the run does not
    fallback_card_gib: float | None  # and what it would take of the card
    reasons: tuple[str, ...]

    def as_record(self) -> dict[str, Any]:
        return asdict(self)
