"""Serve stage: an OpenAI-compatible server on the exported GGUF (llama.cpp's server via llama-cpp-python).

    python -m reprotune.serve [hydra overrides]                          # == make serve
    python -m reprotune.serve export.serve.info_only=true                # == make serve-info

Reads outputs/gguf/model-<export.serve.quant>.gguf (objective=dpo|orpo|kto: outputs/pref/gguf, the preference
run's export: conf/objective/paths/preference.yaml). Binds 127.0.0.1 by default (export.serve.host).
The chat prompt is rendered by the chat template inside the GGUF ('chat_template.default'), the one
'make gguf' checked token for token against the HF tokenizer; llama-cpp-python would otherwise swap in a
built-in format it guesses from the template.

serve-info prints the commands for the other two ways to serve the result: vLLM on base + adapter
(no merge, no quantisation) and Ollama on the GGUF with the generated Modelfile.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.run import Run, resolve

log = logging.getLogger("reprotune.serve")


def parity_report(run: Run) -> dict:
    """outputs/gguf/parity.json (make gguf; the Run's paths.gguf), or {} before the first export."""
    path = run.path("gguf") / "parity.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def serve_quant(cfg: DictConfig, run: Run) -> str:
    """export.serve.quant, else the quant make gguf chose (parity.json: auto's pick, else the first listed)."""
    if cfg.export.serve.quant:
        return str(cfg.export.serve.quant)
    chosen = parity_report(run).get("serve_quant")
    if not chosen:
        raise ReprotuneError(f"serve: {run.path('gguf') / 'parity.json'} names no served quant; run 'make gguf' "
                             "(or set export.serve.quant)")
    return str(chosen)


def gguf_path(cfg: DictConfig, run: Run) -> Path:
    return run.path("gguf") / f"model-{serve_quant(cfg, run)}.gguf"


def served_for_info(cfg: DictConfig, run: Run) -> str:
    """The GGUF make serve would serve, or what it will be once make gguf has run."""
    try:
        return str(gguf_path(cfg, run))
    except ReprotuneError:  # before make gguf: the first quant listed is what it will serve; auto picks one
        quant = cfg.export.quant
        first = quant if isinstance(quant, str) else (list(quant) or ["<none>"])[0]
        return f"{run.path('gguf')}/model-{'<the quant make gguf chooses>' if first == 'auto' else first}.gguf"


def check_gate(cfg: DictConfig, run: Run, quant: str) -> None:
    """Refuse a quant that failed make gguf's parity gate, unless export.serve.allow_failed=true."""
    verdict = parity_report(run).get("gate", {}).get(quant)
    if verdict is None or verdict["passed"] or cfg.export.serve.allow_failed:
        return
    raise ReprotuneError(f"serve: model-{quant}.gguf failed the parity gate of make gguf ({'; '.join(verdict['failed'])}"
                         "); serve it anyway with export.serve.allow_failed=true")


def llama_cpp_settings(cfg: DictConfig, run: Run | None = None):
    """The server's and the model's settings (run: the stage's; default: resolve(cfg, "serve")'s)."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    run = run if run is not None else resolve(cfg, "serve")
    path = gguf_path(cfg, run)
    if not path.is_file():
        raise ReprotuneError(f"serve: {path} not found; run 'make gguf' (export.quant must include "
                          f"{serve_quant(cfg, run)})")
    check_gate(cfg, run, serve_quant(cfg, run))
    server = ServerSettings(host=str(cfg.export.serve.host), port=int(cfg.export.serve.port))
    model = ModelSettings(model=str(path), model_alias=str(cfg.export.name), n_ctx=int(cfg.export.serve.n_ctx),
                          chat_format="chat_template.default", seed=int(cfg.seed), verbose=False,
                          **({"n_threads": int(cfg.export.threads)} if cfg.export.threads else {}))
    return server, model


def vllm_command(cfg: DictConfig, run: Run) -> str:
    from reprotune.models import resolve_model_dir

    adapter = run.path("adapter")
    base = str(cfg.model.path) if cfg.model.source in ("hub", "local") else None
    if base is None:  # built-in / tiny models: the materialised local directory
        base = resolve_model_dir(cfg.model, run.paths["model_cache"])
    parts = ["vllm", "serve", base]
    if cfg.model.source == "hub" and cfg.model.revision:
        parts += ["--revision", str(cfg.model.revision)]
    parts += ["--enable-lora", "--lora-modules", f"{cfg.export.name}={adapter.as_posix()}",
              "--max-lora-rank", str(int(cfg.method.r)),
              "--chat-template", (adapter / "chat_template.jinja").as_posix(),
              "--host", str(cfg.export.serve.host), "--port", "8000"]
    return shlex.join(parts)


def ollama_commands(cfg: DictConfig, run: Run) -> str:
    return (f"cd {shlex.quote(run.paths['gguf'])} && ollama create {shlex.quote(str(cfg.export.name))} "
            f"-f Modelfile && ollama run {shlex.quote(str(cfg.export.name))}")


def info(cfg: DictConfig, run: Run) -> str:
    host, port = cfg.export.serve.host, cfg.export.serve.port
    return "\n".join([
        f"llama.cpp (make serve): OpenAI-compatible API on http://{host}:{port}/v1, model '{cfg.export.name}'",
        f"  {shlex.join(['python', '-m', 'reprotune.serve'])}   # serves {served_for_info(cfg, run)}",
        "vLLM, base + adapter (GPU host; no merge, no quantisation):",
        f"  {vllm_command(cfg, run)}",
        "Ollama, the GGUF with its Modelfile (template, stop tokens, system prompt):",
        f"  {ollama_commands(cfg, run)}",
        *system_lines(cfg, run),
    ])


def system_lines(cfg: DictConfig, run: Run | None = None) -> list[str]:
    """What serve-info says of the training system prompt (reprotune.system_prompt) of the export in the Run's
    paths.gguf (default: resolve(cfg, "serve")'s)."""
    from reprotune.system_prompt import exported_system

    system = exported_system((run if run is not None else resolve(cfg, "serve")).paths["gguf"])
    if system is None:
        return ["System prompt: none (the training conversations share none); requests are served as sent."]
    return [f"System prompt: every training conversation started with {system!r}; make serve and Ollama put it "
            "first in a request that has no system message (vLLM does not: send it yourself)."]


def serve(cfg: DictConfig, run: Run) -> None:
    import uvicorn
    from llama_cpp.server.app import create_app

    server, model = llama_cpp_settings(cfg, run)
    app = create_app(server_settings=server, model_settings=[model])
    from reprotune.system_prompt import DefaultSystem, exported_system

    if (system := exported_system(run.paths["gguf"])) is not None:  # as the Modelfile's SYSTEM does for Ollama
        log.info("requests without a system message get the training one: %r", system)
        app = DefaultSystem(app, system)
    log.info("serving %s as '%s' on http://%s:%d/v1", model.model, model.model_alias, server.host, server.port)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run = resolve(cfg, "serve")
        if cfg.export.serve.info_only:
            print(info(cfg, run))
            return
        serve(cfg, run)


if __name__ == "__main__":
    main()
