"""Persistent JAX compilation cache: Craftax scans take minutes to compile on a 2-core CPU.

Every `thinkcraft` command uses it (`cli.main` calls `configure_process_cache` before a command is
imported): the first run of a command compiles and writes its programs to the cache, later identical runs
read them back. The cache key is the lowered program with its debug info stripped, the compile options,
the jaxlib version and the device kind (`jax._src.cache_key.get`), so nothing run-specific (run dir, time)
enters it; programs with host callbacks (`jax.debug.print`) are never written, so the training chunks
must not contain any.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "thinkcraft" / "jax"

# cache every program, the eager ops' small ones too: on a 2-core CPU they are ~1.5 s of the 10 s that
# `render --steps 5` still takes with its rollout programs cached (8.6 s with them cached as well)
MIN_COMPILE_TIME_S = 0.0
# -1: no size floor, and JAX may not override it
MIN_ENTRY_SIZE_BYTES = -1


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: `path`, else $JAX_COMPILATION_CACHE_DIR, else ~/.cache/thinkcraft/jax."""
    return Path(path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIR)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent cache (honours $JAX_COMPILATION_CACHE_DIR). Safe to call repeatedly."""
    import jax

    d = cache_dir(path)
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
    return d


def configure_process_cache() -> tuple[Path, bool]:
    """Point this process's JAX (imported now or later) at the cache without importing JAX.

    JAX reads each `jax_*` option's default from the upper-cased environment variable when it is first
    imported, so setting the variables here costs nothing for commands that never import JAX; if JAX is
    already imported (a test calling `cli.main`) the options are set directly. Variables the user set win.
    Returns (directory, first_use): first_use when the directory is missing or empty (nothing cached yet).
    """
    d = cache_dir()
    first_use = not d.is_dir() or not any(d.iterdir())
    d.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(d))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_TIME_S))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", str(MIN_ENTRY_SIZE_BYTES))
    if "jax" in sys.modules:
        enable_compilation_cache(d)
    return d, first_use
