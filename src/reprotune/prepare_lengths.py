"""Token lengths of prepared conversations, in the tokenizer and chat template training uses: counted in batches
(rendered with any tools), and the data.overlong policy (drop, or truncate the last reply) applied to them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from omegaconf import DictConfig

from reprotune.errors import ReprotuneError
from reprotune.prepare_report import AtLeast
from reprotune.run import Run, resolve


def load_tokenizer(cfg: DictConfig, run: Run | None = None) -> Any:
    """The model's tokenizer with the chat template training uses (model.chat_template overrides it), from the
    Run's paths.model_cache (default: resolve(cfg, "prepare")'s)."""
    from reprotune.models import load_tokenizer as load
    from reprotune.models import resolve_model_dir

    run = run if run is not None else resolve(cfg, "prepare")
    return load(resolve_model_dir(cfg.model, run.paths["model_cache"]), cfg.model)


# conversations rendered and tokenized at a time: the fast tokenizer keeps an Encoding (ids, offsets, masks)
# per text of a batch, so one batch of the whole dataset cost ~5 kB per example (525 MB at 100k short lines)
LENGTH_BATCH = 1024


def longest_token(tokenizer: Any) -> int:
    """Characters the longest vocabulary entry spells (byte-level BPE: bytes, which bound the characters): no
    token covers more, so a text of more than `max_length * longest_token` characters is over max_length
    tokens without tokenizing it."""
    key = id(tokenizer)
    if key not in _LONGEST:
        _LONGEST[key] = max(len(token) for token in tokenizer.get_vocab())
    return _LONGEST[key]


_LONGEST: dict[int, int] = {}


def token_lengths(tokenizer: Any, conversations: list[list[dict]], tools: list[list | None] | None = None,
                  max_length: int | None = None) -> list[int]:
    """Token count of each rendered conversation. With max_length, the cheap character check first: a text
    certainly over max_length tokens is not tokenized (a 50 MB reply cost 6.6 GB) and gets the lower bound
    `AtLeast(characters // longest_token + 1)`, over max_length, so the length policy treats it as before."""
    tools = tools or [None] * len(conversations)
    cap = max_length * longest_token(tokenizer) if max_length else None
    lengths: list[int] = []
    for start in range(0, len(conversations), LENGTH_BATCH):
        texts = rendered(tokenizer, conversations[start:start + LENGTH_BATCH], tools[start:start + LENGTH_BATCH])
        measured = iter(count_tokens(tokenizer, [t for t in texts if cap is None or len(t) <= cap]))
        lengths += [AtLeast(len(t) // (cap // max_length) + 1) if cap is not None and len(t) > cap
                    else next(measured) for t in texts]
    return lengths


def rendered(tokenizer: Any, conversations: list[list[dict]], tools: list[list | None]) -> list[str]:
    """Each conversation rendered with the chat template, with its tools where it has some. Those without tools
    go in one call (the template compiled once, not checked again per conversation)."""
    texts: list[str] = [""] * len(conversations)
    plain = [i for i, t in enumerate(tools) if t is None]
    if plain:
        for i, text in zip(plain, tokenizer.apply_chat_template([conversations[i] for i in plain], tokenize=False),
                           strict=True):
            texts[i] = text
    for i, t in enumerate(tools):
        if t is not None:
            texts[i] = tokenizer.apply_chat_template(conversations[i], tools=t, tokenize=False)
    return texts


def count_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    """How many tokens each text is, no special tokens added. A fast tokenizer's own Rust tokenizer counts them
    (encode_batch_fast: no character offsets, no Python lists of ids and masks; half the time of
    tokenizer(texts) at 1 M lines) unless its tokenizer.json sets truncation or padding, which would change the
    counts (tokenizer(texts) turns them off)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [len(encoding) for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def truncate_last_reply(tokenizer: Any, messages: list[dict], max_length: int,
                        tools: list | None = None) -> list[dict] | None:
    """Shorten the final assistant reply so the whole conversation fits; None when the prompt alone does not
    (or the reply is a tool call: half a call teaches nothing)."""
    if messages[-1].get("tool_calls"):
        return None
    reply = messages[-1]["content"]
    widest = longest_token(tokenizer)
    if sum(len(m.get("content") or "") for m in messages[:-1]) > max_length * widest:
        return None  # the prompt alone is over max_length tokens: no cut of the reply fits
    # what fits is within the first max_length tokens, at most max_length * widest characters: the rest of a
    # huge reply is never tokenized (twice that kept, so the cut point is far from where the tokens end)
    reply = reply[: 2 * max_length * widest]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    cut_messages = [*messages[:-1], {**messages[-1], "content": reply}]
    overhead = token_lengths(tokenizer, [cut_messages], [tools])[0] - len(reply_ids)
    budget = max_length - overhead
    while budget > 0:
        candidate = [*messages[:-1], {**messages[-1], "content": tokenizer.decode(reply_ids[:budget])}]
        if candidate[-1]["content"].strip() and token_lengths(tokenizer, [candidate], [tools])[0] <= max_length:
            return candidate
        budget -= 1  # re-tokenising a cut can merge differently; step back until it fits
    return None


def apply_length_policy(tokenizer: Any, conversations: list[list[dict]], lengths: list[int], max_length: int,
                        policy: str, tools: list[list | None] | None = None
                        ) -> tuple[list[list[dict] | None], list[int], Counter]:
    """Over-long examples are dropped (policy drop) or have their last reply cut to fit (policy truncate)."""
    if policy not in ("drop", "truncate"):
        raise ReprotuneError([f"data.overlong: unknown policy {policy!r} (drop or truncate)"])
    counts: Counter = Counter()
    out, out_lengths = [], []
    tools = tools or [None] * len(conversations)
    for conv, n, conv_tools in zip(conversations, lengths, tools, strict=True):
        if n <= max_length:
            out.append(conv)
            out_lengths.append(n)
            continue
        counts["overlong"] += 1
        cut = truncate_last_reply(tokenizer, conv, max_length, conv_tools) if policy == "truncate" else None
        if cut is None:
            counts["dropped"] += 1
            out.append(None)
            out_lengths.append(n)
        else:
            counts["truncated"] += 1
            out.append(cut)
            out_lengths.append(token_lengths(tokenizer, [cut], [conv_tools])[0])
    return out, out_lengths, counts
