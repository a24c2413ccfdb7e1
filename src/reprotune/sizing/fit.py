"""Which settings fit a card: the candidates weighed for a run (larger packed micro-steps, no, partial or full
checkpointing, fewer rows, QLoRA for a 16-bit LoRA) and the fastest of those that fit. No torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from reprotune.run_settings import Settings
from reprotune.sizing.host import FEWEST
from reprotune.sizing.memory import GIB, memory, needed_bytes
from reprotune.sizing.shape import DataShape, Shape, count_params, load_table
from reprotune.sizing.throughput import model_tokens_per_second

PARTIAL_EVERY = (8, 6, 4, 3, 2)  # every_n_layers tried between no checkpointing and all layers
# The MLP tiles of the long-context fallback (reprotune.tiled_mlp), largest first: a larger tile runs faster (fewer
# recomputed pieces; measured: docs/gpu.md, "Long context on one card"), a smaller one keeps less (Liger's and DeepSpeed's TiledMLP default is about the hidden size, 4,096 for an 8B).
# The fit weighs both; hardware.tiled_mlp_tokens names one.
TILE_SIZES = (16384, 4096)
TILE_TOKENS = TILE_SIZES[0]  # hardware.tiled_mlp=true without hardware.tiled_mlp_tokens


def long_context_options(s: Settings) -> list[Settings]:
    """Every layer checkpointed, then the layer inputs offloaded to host memory (no measurable cost on the GPU:
    docs/gpu.md, "Long context on one card"), then also the MLP over tiles (one more MLP forward per
    layer in the backward), large tiles before small: smallest last."""
    full = replace(s, checkpointing=True, ckpt_every=1)
    # a tile cuts the sequence axis: the one flattened row of a packed micro-step, each row of a padded one; a
    # tile as long as that changes nothing (reprotune.tiled_mlp runs the MLP whole)
    sequence = s.batch_size * s.max_length if s.packing else s.max_length
    return [full, replace(full, offload=True),
            *[replace(full, offload=True, tiled_mlp=t) for t in TILE_SIZES if t < sequence]]


def allowed(cands: list[Settings], offload: bool | None, tiled: bool | None,
            tile: int | None = None, offload_layers: int | None = None) -> list[Settings]:
    """The candidates hardware.activation_offloading / hardware.tiled_mlp allow (None: auto, either); tile
    (hardware.tiled_mlp_tokens): the one tile size a tiled candidate may use; offload_layers
    (hardware.offload_layers): how many layer inputs an offloading candidate sends to the host (None: the fit's)."""
    out: list[Settings] = []
    for c in cands:
        if (offload is not None and c.offload != offload) or (tiled is not None and bool(c.tiled_mlp) != tiled):
            continue
        c = replace(c, tiled_mlp=tile) if tile and c.tiled_mlp else c
        c = replace(c, offload_layers=offload_layers) if offload_layers and offload_layers > 0 and c.offload else c
        if c not in out:
            out.append(c)
    return out


# More tokens per micro-step amortise its fixed per-layer costs (kernel launches, PEFT's Python, NF4 dequantisation:
# throughput.yaml's layer_pass_ms), so the preflight may trade gradient accumulation for rows. Up to the largest
# packed micro-step measured on the H200 (16 rows of 1,100 tokens: 8B QLoRA, checkpointing every layer).
MAX_MICRO_STEP_TOKENS = 17_600


def rebatched(s: Settings) -> list[Settings]:
    """The same global batch (rows x accumulation) in fewer, larger packed micro-steps; largest first."""
    if not s.packing:
        return []
    total = s.batch_size * s.grad_accum
    return [replace(s, batch_size=r, grad_accum=total // r) for r in range(total, s.batch_size, -1)
            if total % r == 0 and r * s.max_length <= MAX_MICRO_STEP_TOKENS]


def checkpointing_options(s: Settings) -> list[Settings]:
    """No checkpointing, every n-th layer, every layer: fastest to smallest at these rows."""
    return ([replace(s, checkpointing=False, offload=False, tiled_mlp=0)]
            + [replace(s, checkpointing=True, ckpt_every=n, offload=False, tiled_mlp=0) for n in PARTIAL_EVERY]
            + long_context_options(s))


def same_method_candidates(s: Settings) -> list[Settings]:
    """Everything the preflight weighs for the configured method: larger packed micro-steps (each with every
    checkpointing option), then candidate_settings' ladder of the same method."""
    return ([o for r in rebatched(s) for o in checkpointing_options(r)]
            + [c for c in candidate_settings(s) if c.load_in_4bit == s.load_in_4bit])


def candidate_settings(s: Settings) -> list[Settings]:
    """From fastest to smallest: no checkpointing, every n-th layer checkpointed, every layer, smaller
    micro-batches (same effective batch), then QLoRA for a 16-bit LoRA."""
    plain = replace(s, offload=False, tiled_mlp=0)
    ladder = [replace(plain, checkpointing=False)]
    # some layers before all of them: each recomputed layer costs time (the throughput model, docs/plan.md)
    ladder += [replace(plain, checkpointing=True, ckpt_every=n) for n in PARTIAL_EVERY]
    ladder += long_context_options(plain)  # every layer, then offloaded, then the tiled MLP (issue #27)
    # KTO's KL term needs two rows or more (TRL 1.16's KTOTrainer refuses one)
    for bs in [r for r in range(s.batch_size - 1, 1 if s.kl_rows else 0, -1) if s.batch_size % r == 0]:
        ladder += long_context_options(replace(plain, batch_size=bs,
                                               grad_accum=max(1, s.grad_accum * s.batch_size // bs)))
    if not s.load_in_4bit:
        q = replace(s, method="qlora", load_in_4bit=True, double_quant=True)
        ladder += [replace(c, method="qlora", load_in_4bit=True, double_quant=True) for c in ladder if
                   c.checkpointing] or [q]
    return ladder


def with_host_embedding(cands: list[Settings], host: bool | None) -> list[Settings]:
    """The candidates with the input embedding where hardware.embedding_on_host puts it: on the host (True), on
    the GPU (False), or each both ways (None: auto; on the host only costs time, so the fit takes it only where
    it lets a faster setting fit)."""
    if host is None:
        return [c for cand in cands for c in (replace(cand, host_embedding=False), replace(cand, host_embedding=True))]
    return [replace(c, host_embedding=host) for c in cands]


def fits_host(mem: dict[str, Any], host_bytes: float | None) -> bool:
    """Offloaded activations fit the host budget (None: not checked, e.g. a card make plan only describes)."""
    return host_bytes is None or mem["host_offload_gib"] * GIB <= host_bytes


def card_need(shape: Shape, s: Settings, data: DataShape | None, consts: dict[str, Any]) -> float:
    """What `s` needs free on the card (reserved peak + CUDA context + margin), bytes."""
    return needed_bytes(memory(shape, count_params(shape, list(s.targets), s.r, s.dora), s, data, consts), consts)


def fewest_offloaded(shape: Shape, s: Settings, data: DataShape | None, capacity_bytes: float,
                     consts: dict[str, Any]) -> Settings:
    """The card before the host (issue #48): an offloading candidate that sends every layer input to the host, with
    as few of them sent (the first layers'; the rest stay on the GPU) as still fit the card. The card's need falls
    as more go, so a bisection finds the fewest; unchanged when it does not fit with all of them offloaded, or when
    hardware.offload_layers fixed the number."""
    if not s.offload or s.offload_layers or card_need(shape, s, data, consts) > capacity_bytes:
        return s
    lo, hi = 1, shape.layers  # hi: fits
    while lo < hi:
        mid = (lo + hi) // 2
        if card_need(shape, replace(s, offload_layers=mid), data, consts) <= capacity_bytes:
            hi = mid
        else:
            lo = mid + 1
    return s if hi >= shape.layers else replace(s, offload_layers=hi)


def fastest_fitting(shape: Shape, cands: list[Settings], data: DataShape | None, capacity_bytes: float,
                    consts: dict[str, Any], throughput: dict[str, Any],
                    host_bytes: float | None = None, fewest: bool = False) -> tuple[Settings, dict[str, Any]] | None:
    """Of the candidates whose card need and host need (offloaded: host_bytes, the host budget) both fit, the one
    the throughput model predicts fastest (the earlier one on a tie); with `fewest` (hardware.offload_layers=auto)
    an offloading candidate offloads only the layer inputs the card cannot keep (fewest_offloaded). None when none
    fits."""
    best = None
    for cand in cands:
        cand = fewest_offloaded(shape, cand, data, capacity_bytes, consts) if fewest else cand
        mem = memory(shape, count_params(shape, list(cand.targets), cand.r, cand.dora), cand, data, consts)
        if needed_bytes(mem, consts) > capacity_bytes or not fits_host(mem, host_bytes):
            continue
        tps = model_tokens_per_second(shape, cand, data, throughput)
        if best is None or tps > best[0]:
            best = (tps, cand, mem)
    return (best[1], best[2]) if best else None


def fitting_setting(shape: Shape, s: Settings, data: DataShape | None, capacity_gib: float,
                    consts: dict[str, Any], offload: bool | None = None, tiled: bool | None = None,
                    host_bytes: float | None = None, tile: int | None = None,
                    host_embedding: bool | None = False,
                    offload_layers: int | None = None) -> tuple[Settings, dict[str, Any]] | None:
    """What fits a card (and the host budget): the fastest fitting setting of the configured method (larger
    micro-steps, then candidate_settings' ladder), else of the ladder's QLoRA fallback; offload/tiled/
    host_embedding/offload_layers: as fit_to_budget's."""
    throughput = load_table("throughput.yaml")
    for cands in (same_method_candidates(s), [c for c in candidate_settings(s) if c.load_in_4bit != s.load_in_4bit]):
        cands = with_host_embedding(allowed(cands, offload, tiled, tile, offload_layers), host_embedding)
        found = fastest_fitting(shape, cands, data, capacity_gib * GIB, consts, throughput, host_bytes,
                                fewest=offload_layers == FEWEST)
        if found:
            return found
    return None


def fit_to_budget(s: Settings, forced: bool, shape: Shape, data: DataShape | None, budget_bytes: float,
                  consts: dict[str, Any], offload: bool | None = None, tiled: bool | None = None,
                  host_bytes: float | None = None, tile: int | None = None,
                  host_embedding: bool | None = False,
                  offload_layers: int | None = None) -> tuple[Settings, dict[str, Any]]:
    """The setting the throughput model predicts fastest among those whose card need fits the budget (the same
    global batch in larger packed micro-steps, then candidate_settings' ladder; the method is never changed),
    else the ladder's smallest; `s` as it is when checkpointing is forced (hardware.gradient_checkpointing).
    offload/tiled: hardware.activation_offloading / hardware.tiled_mlp when set (None: auto); host_bytes: the
    host memory offloading may take (None: not checked); tile: hardware.tiled_mlp_tokens when set;
    host_embedding: the input embedding on the host (True), on the GPU (False), either (None; forced: the GPU);
    offload_layers: hardware.offload_layers when set (None: an offloading candidate offloads what the card cannot
    keep)."""
    cands = ([replace(s, host_embedding=bool(host_embedding))] if forced
             else with_host_embedding(allowed(same_method_candidates(s), offload, tiled, tile, offload_layers),
                                      host_embedding))
    if not forced:
        found = fastest_fitting(shape, cands, data, budget_bytes, consts, load_table("throughput.yaml"), host_bytes,
                                fewest=offload_layers == FEWEST)
        if found:
            return found
    last = cands[-1]
    return last, memory(shape, count_params(shape, list(last.targets), last.r, last.dora), last, data, consts)


def both_budgets(card_gib: float, budget_gib: float, host_gib: float, host_budget_gib: float | None) -> str:
    """The two numbers a refusal names (issue #48): what the smallest setting needs of the card and of the host,
    each against its budget."""
    host = (f"host budget {host_budget_gib:.1f} GiB (hardware.host_memory_budget_gib)" if host_budget_gib is not None
            else "host budget not checked")
    return f"needs {card_gib} GiB of the card (budget {budget_gib:.1f} GiB) and {host_gib} GiB of host memory ({host})"


def checkpointing_words(checkpointing: bool, every: int) -> str:
    return "off" if not checkpointing else ("on" if every == 1 else f"every {every} layers")


def describe(s: Settings) -> str:
    if s.packing:
        tokens = f"{s.batch_size}x{s.max_length} packed"
    elif s.sequences > 1:  # padded preference pairs: two rows each
        tokens = f"bs {s.batch_size} pairs ({s.batch_size * s.sequences} padded rows)"
    else:
        tokens = f"bs {s.batch_size}"
    offloaded = f" (the first {s.offload_layers} layers' inputs)" if s.offload_layers else ""
    long = ((f", activations offloaded to host{offloaded}" if s.offload else "")
            + (f", MLP in {s.tiled_mlp}-token tiles" if s.tiled_mlp else "")
            + (", input embedding on the host" if s.host_embedding else ""))
    return (f"{s.method}{' (NF4)' if s.load_in_4bit else ''}, checkpointing {checkpointing_words(s.checkpointing, s.ckpt_every)}"
            f"{long}, {tokens}, grad-accum {s.grad_accum}")


def overrides_for(s: Settings, base: Settings) -> list[str]:
    out = []
    if s.load_in_4bit and not base.load_in_4bit:
        out.append("method=qlora")
    out.append(f"hardware.gradient_checkpointing={str(s.checkpointing).lower()}")
    if s.checkpointing and s.ckpt_every > 1:
        out.append(f"++train.activation_checkpointing_kwargs.every_n_layers={s.ckpt_every}")
    if s.offload != base.offload:
        out.append(f"hardware.activation_offloading={str(s.offload).lower()}")
    if s.offload and s.offload_layers and s.offload_layers != base.offload_layers:
        out.append(f"hardware.offload_layers={s.offload_layers}")
    if bool(s.tiled_mlp) != bool(base.tiled_mlp):
        out.append(f"hardware.tiled_mlp={str(bool(s.tiled_mlp)).lower()}")
    if s.host_embedding != base.host_embedding:
        out.append(f"hardware.embedding_on_host={str(s.host_embedding).lower()}")
    if s.batch_size != base.batch_size:
        out += [f"train.per_device_train_batch_size={s.batch_size}", f"train.gradient_accumulation_steps={s.grad_accum}"]
    return out
