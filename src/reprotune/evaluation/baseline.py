"""The prompt-only baseline: the same holdout through any OpenAI-compatible endpoint (eval.baseline.url), greedy.
If a well-prompted base model is almost as good, fine-tuning was not needed."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from omegaconf import DictConfig

from reprotune.errors import ReprotuneError
from reprotune.evaluation.generation import SystemRun
from reprotune.evaluation.holdout import Example


def baseline_messages(prompt: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The holdout prompt, with the configured system prompt in place of the example's own (if set)."""
    if system_prompt is None:
        return list(prompt)
    rest = prompt[1:] if prompt and prompt[0]["role"] == "system" else prompt
    return [{"role": "system", "content": system_prompt}, *rest]


def run_baseline(cfg: DictConfig, examples: Sequence[Example]) -> SystemRun:
    """The same holdout through an OpenAI-compatible chat endpoint, greedy (temperature 0); text prompts through
    its completions endpoint, as they are."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from tqdm.auto import tqdm

    b = cfg.eval.baseline
    if not b.model:
        raise ReprotuneError("eval.baseline.model: must name the model the endpoint serves")
    # local servers ignore the key but the client insists on one; a real key only ever comes from the env
    key = os.environ.get(b.api_key_env or "", "") or "no-key"
    client = openai.OpenAI(base_url=b.url, api_key=key, timeout=float(b.timeout_s), max_retries=int(b.max_retries))
    max_tokens = int(b.max_tokens or cfg.eval.max_new_tokens)

    def ask(ex: Example) -> tuple[str, int]:
        if isinstance(ex.prompt, str):
            done = client.completions.create(model=b.model, prompt=ex.prompt, temperature=0.0, max_tokens=max_tokens,
                                             seed=int(cfg.seed))
            usage = done.usage.completion_tokens if done.usage else 0
            return (done.choices[0].text or "").strip(), int(usage or 0)
        reply = client.chat.completions.create(
            model=b.model, messages=baseline_messages(ex.prompt, b.system_prompt), temperature=0.0,
            max_tokens=max_tokens, seed=int(cfg.seed))
        usage = reply.usage.completion_tokens if reply.usage else 0
        return (reply.choices[0].message.content or "").strip(), int(usage or 0)

    started = time.time()
    try:
        with ThreadPoolExecutor(max_workers=max(1, int(b.concurrency))) as pool:
            answers = list(tqdm(pool.map(ask, examples), total=len(examples), desc="prompt baseline",
                                unit="example"))
    except openai.APIConnectionError as err:
        raise ReprotuneError(f"eval.baseline.url: {b.url}: cannot connect ({err.__cause__ or err})") from None
    except openai.APIStatusError as err:
        raise ReprotuneError(f"eval.baseline.url: {b.url}: HTTP {err.status_code} for model "
                             f"{b.model!r}; check eval.baseline.model and ${b.api_key_env}") from None
    run = SystemRun([a for a, _ in answers], [n for _, n in answers])
    run.seconds = time.time() - started
    return run
