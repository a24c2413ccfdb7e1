"""Serve stage: an OpenAI-compatible server on the exported GGUF (llama.cpp's server via llama-cpp-python).

    python -m reprotune.serve [hydra overrides]                          # == make serve
    python -m reprotune.serve export.serve.info_only=true                # == make serve-info

Reads outputs/gguf/model-<export.serve.quant>.gguf (objective=dpo|orpo|kto: outputs/pref/gguf, the preference
run's export, reprotune.preference.route_paths). Binds 127.0.0.1 by default (export.serve.host).
The chat prompt is rendered by the chat template inside the GGUF ('chat_template.default'), the one
'make gguf' checked token for token against the HF tokenizer; llama-cpp-python would otherwise swap in a
built-in format it guesses from the template.

serve-info prints the commands for the other two ways to serve the result: vLLM on base + adapter
(no merge, no quantisation) and Ollama on the GGUF with the generated Modelfile.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.preference import route_paths

log = logging.getLogger("reprotune.serve")


def gguf_path(cfg: DictConfig) -> Path:
    return Path(cfg.paths.gguf) / f"model-{cfg.export.serve.quant}.gguf"


def llama_cpp_settings(cfg: DictConfig):
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    path = gguf_path(cfg)
    if not path.is_file():
        raise ReprotuneError(f"serve: {path} not found; run 'make gguf' (export.quant must include "
                          f"{cfg.export.serve.quant})")
    server = ServerSettings(host=str(cfg.export.serve.host), port=int(cfg.export.serve.port))
    model = ModelSettings(model=str(path), model_alias=str(cfg.export.name), n_ctx=int(cfg.export.serve.n_ctx),
                          chat_format="chat_template.default", seed=int(cfg.seed), verbose=False,
                          **({"n_threads": int(cfg.export.threads)} if cfg.export.threads else {}))
    return server, model


def vllm_command(cfg: DictConfig) -> str:
    from reprotune.models import resolve_model_dir

    adapter = Path(cfg.paths.adapter)
    base = str(cfg.model.path) if cfg.model.source in ("hub", "local") else None
    if base is None:  # built-in / tiny models: the materialised local directory
        base = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    parts = ["vllm", "serve", base]
    if cfg.model.source == "hub" and cfg.model.revision:
        parts += ["--revision", str(cfg.model.revision)]
    parts += ["--enable-lora", "--lora-modules", f"{cfg.export.name}={adapter.as_posix()}",
              "--max-lora-rank", str(int(cfg.method.r)),
              "--chat-template", (adapter / "chat_template.jinja").as_posix(),
              "--host", str(cfg.export.serve.host), "--port", "8000"]
    return shlex.join(parts)


def ollama_commands(cfg: DictConfig) -> str:
    return (f"cd {shlex.quote(str(cfg.paths.gguf))} && ollama create {shlex.quote(str(cfg.export.name))} "
            f"-f Modelfile && ollama run {shlex.quote(str(cfg.export.name))}")


def info(cfg: DictConfig) -> str:
    host, port = cfg.export.serve.host, cfg.export.serve.port
    return "\n".join([
        f"llama.cpp (make serve): OpenAI-compatible API on http://{host}:{port}/v1, model '{cfg.export.name}'",
        f"  {shlex.join(['python', '-m', 'reprotune.serve'])}   # serves {gguf_path(cfg)}",
        "vLLM, base + adapter (GPU host; no merge, no quantisation):",
        f"  {vllm_command(cfg)}",
        "Ollama, the GGUF with its Modelfile (template, stop tokens, system prompt):",
        f"  {ollama_commands(cfg)}",
        *system_lines(cfg),
    ])


def system_lines(cfg: DictConfig) -> list[str]:
    """What serve-info says of the training system prompt (reprotune.system_prompt)."""
    from reprotune.system_prompt import exported_system

    system = exported_system(cfg.paths.gguf)
    if system is None:
        return ["System prompt: none (the training conversations share none); requests are served as sent."]
    return [f"System prompt: every training conversation started with {system!r}; make serve and Ollama put it "
            "first in a request that has no system message (vLLM does not: send it yourself)."]


def serve(cfg: DictConfig) -> None:
    import uvicorn
    from llama_cpp.server.app import create_app

    server, model = llama_cpp_settings(cfg)
    app = create_app(server_settings=server, model_settings=[model])
    from reprotune.system_prompt import DefaultSystem, exported_system

    if (system := exported_system(cfg.paths.gguf)) is not None:  # as the Modelfile's SYSTEM does for Ollama
        log.info("requests without a system message get the training one: %r", system)
        app = DefaultSystem(app, system)
    log.info("serving %s as '%s' on http://%s:%d/v1", model.model, model.model_alias, server.host, server.port)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        route_paths(cfg)  # make serve ARGS="objective=dpo": the preference run's GGUF and adapter
        if cfg.export.serve.info_only:
            print(info(cfg))
            return
        serve(cfg)


if __name__ == "__main__":
    main()
