"""Weight files a learner writes for a server to load (the async llm-policy's HTTP engines).

- thinkcraft weight file (`thinkcraft serve` POST /update_weights): one torch file
  {"version": int, "kind": "full" | "lora", "state": {name: tensor}, "meta": {...} | None}; for LoRA, meta
  holds "lora_scaling" (alpha / r) and "peft_config" (plain JSON values, so `torch.load(weights_only=True)`
  reads it).
- HF folder (SGLang /update_weights_from_disk, vLLM reload_weights and /v1/load_lora_adapter): full weights
  as model.safetensors beside the base model's config and tokenizer files, or a PEFT adapter folder.

Both are written atomically (a temporary name, then a rename): a server never reads half a file.
`update` arguments are anything with .version, .kind, .state, .meta (pools.weights.WeightUpdate).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def lora_meta(model: Any) -> dict[str, Any]:
    """What a server needs besides the adapter tensors: the scaling alpha / r and the PEFT config."""
    cfg = model.peft_config["default"]
    plain = json.loads(json.dumps(cfg.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    return {"lora_scaling": float(cfg.lora_alpha) / float(cfg.r), "peft_config": plain}


def write_weight_file(path: Path, update: Any) -> Path:
    """The update as a thinkcraft weight file."""
    import torch

    from thinkcraft.utils.io import atomic_path

    path = Path(path)
    with atomic_path(path) as tmp:
        torch.save({"version": update.version, "kind": update.kind, "state": update.state, "meta": update.meta}, tmp)
    return path


def read_weight_file(path: Path) -> dict[str, Any]:
    """A thinkcraft weight file's dict (tensors and plain values only: weights_only)."""
    import torch

    data = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or not isinstance(data.get("state"), dict):
        raise ValueError(f"{path} is not a thinkcraft weight file ({{version, kind, state}})")
    return data


def write_hf_weights(update: Any, out_dir: Path, base_model_dir: str) -> Path:
    """The update as an HF folder: model.safetensors + the base model's other files, or a PEFT adapter."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in (update.state or {}).items()}
    if update.kind == "lora":  # PEFT's saved names drop the adapter name ("....lora_A.default.weight")
        save_file({k.replace(".default.", "."): v for k, v in state.items()}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps((update.meta or {}).get("peft_config", {})))
    else:
        weights = (".safetensors", ".bin", ".gguf", ".pt")
        for f in Path(base_model_dir).iterdir():
            if f.is_file() and not f.name.endswith(weights) and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        save_file(state, str(tmp / "model.safetensors"))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
