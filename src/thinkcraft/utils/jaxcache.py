"""Persistent JAX compilation cache: Craftax scans take minutes to compile on a 2-core CPU."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "thinkcraft" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent cache (honours $JAX_COMPILATION_CACHE_DIR). Safe to call repeatedly."""
    import jax

    d = Path(path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIR)
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    # cache everything, including fast compiles: CPU compiles of small functions still add up
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return d
