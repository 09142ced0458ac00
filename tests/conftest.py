"""Shared test setup: one persistent JAX compilation cache for the whole suite (and across runs)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from thinkcraft.utils.jaxcache import enable_compilation_cache  # noqa: E402

enable_compilation_cache()
