"""Export benchmark: merge, convert and quantize times on this machine, and the GGUF parity numbers.

    python bench/export_bench.py [hydra overrides]     # after 'make train'; default: built-in SmolLM2

Runs the merge and gguf stages exactly as 'make merge' / 'make gguf' do (one process each, with the same
overrides), then prints one table from their manifests and parity reports (outputs/export/*.json,
outputs/merged/parity.json, outputs/gguf/parity.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(module: str, overrides: list[str]) -> float:
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    subprocess.run([sys.executable, "-m", module, *overrides], check=True, cwd=REPO, env=env)
    return time.time() - t0


def main(overrides: list[str]) -> None:
    from reprotune.config import compose

    cfg = compose(overrides)
    wall = {"merge": run("reprotune.merge", overrides), "gguf": run("reprotune.gguf", overrides)}
    export_dir, gguf_dir = Path(cfg.paths.export_dir), Path(cfg.paths.gguf)
    merge_m = json.loads((export_dir / "merge_manifest.json").read_text())
    gguf_m = json.loads((export_dir / "gguf_manifest.json").read_text())
    parity = json.loads((gguf_dir / "parity.json").read_text())
    mparity = merge_m["parity"]
    hw = merge_m["hardware"]

    print(f"\n## Export benchmark: model={cfg.model.name}, {hw['cpu']} ({hw['cpu_count']} cores), "
          f"llama-cpp-python {gguf_m['llama_cpp']['llama_cpp_python']}\n")
    print("| step | seconds |\n|---|---:|")
    t = merge_m["timing"]
    print(f"| merge: load base fp32 + adapter, merge, logit parity | {t['merge_seconds']:.1f} |")
    print(f"| merge: save {mparity['saved']['dtype']} safetensors | {t['save_seconds']:.1f} |")
    print(f"| make merge (process wall, incl. imports and reload check) | {wall['merge']:.1f} |")
    for k, v in gguf_m["timing"].items():
        if k != "wall_seconds":
            print(f"| gguf: {k.removesuffix('_seconds').replace('_', ' ')} | {v:.1f} |")
    print(f"| make gguf (process wall) | {wall['gguf']:.1f} |")

    print("\n| merge parity (vs base + adapter, fp32) | max abs Δlogit | top-1 agreement |\n|---|---:|---:|")
    print(f"| adapter effect (base alone) | {mparity['adapter_effect']['max_abs_diff']:.4f} | "
          f"{mparity['adapter_effect']['top1_agreement']:.4f} |")
    print(f"| fp32 merge | {mparity['fp32_merge']['max_abs_diff']:.2e} | {mparity['fp32_merge']['top1_agreement']:.4f} |")
    print(f"| saved {mparity['saved']['dtype']} | {mparity['saved']['max_abs_diff']:.4f} | "
          f"{mparity['saved']['top1_agreement']:.4f} |")

    print(f"\n| GGUF ({parity['holdout_prompts']} holdout prompts; greedy on {parity['greedy_prompts']}, "
          f"≤{parity['max_new_tokens']} tokens) | prompt ids = HF | greedy exact match vs HF | token agreement "
          "| size MiB | type mix (share of bytes) |\n|---|---|---:|---:|---:|---|")
    for name, g in parity["greedy"].items():
        mix = ", ".join(f"{t} {v['share_of_bytes']:.1%} ({v['tensors']})" for t, v in parity["type_mix"][name].items())
        size = gguf_m["outputs"][name]["bytes"] / 2**20
        print(f"| model-{name}.gguf | {'yes' if parity['tokenization'][name]['identical'] else 'NO'} | "
              f"{g['exact_matches']}/{g['prompts']} ({g['exact_match_rate']:.0%}) | "
              f"{g['token_prefix_agreement']:.1%} | {size:.1f} | {mix} |")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    main(sys.argv[1:])
