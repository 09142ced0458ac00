"""Craftax's short inner loops traced unrolled: the `unroll_env_scans` patch.

One name family everywhere: `unroll_env_scans` is the CLI flag and config field (`auto | on | off`,
`train ppo` / `ppo-hidden`), the `VecEnv` field and `make_env` argument (a bool, or the same setting), and
this module's context manager; `resolve_unroll_env_scans` turns a setting into a bool.

Why: on a GPU each XLA while-loop iteration is driven by the host, and a Craftax step holds eight short
scans (mob / projectile / plant slots), world generation's, and ~100 binary-search iterations (inside
`jax.random.choice(..., p=...)`); at 128 envs the env is bound by those round trips, not by the GPU.
Unrolled, XLA fuses across the iterations. Same algorithms, so the same states (tests/test_envs.py checks
it bit for bit). On a CPU the loops cost nothing and the ~40 s of extra compile would, so `auto` is on
exactly when JAX's default backend is a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp

UnrollSetting = Literal["auto", "on", "off"]
UNROLL_SETTINGS: tuple[str, ...] = ("auto", "on", "off")

_UNROLL_LOCK = threading.RLock()  # re-entrant: a trace may nest these contexts


def resolve_unroll_env_scans(setting: UnrollSetting | bool) -> bool:
    """`auto | on | off` (or a bool, passed through) -> whether to unroll; auto = JAX runs on a GPU."""
    if isinstance(setting, bool):
        return setting
    if setting not in UNROLL_SETTINGS:
        raise ValueError(f"unroll_env_scans must be one of {UNROLL_SETTINGS} or a bool, not {setting!r}")
    if setting == "auto":
        return jax.default_backend() == "gpu"
    return setting == "on"


@contextlib.contextmanager
def unroll_env_scans(enabled: bool = True) -> Iterator[None]:
    """While tracing craftax code: every `jax.lax.scan` it calls runs with `unroll=True`, and every
    `searchsorted` (inside `jax.random.choice(..., p=...)`, 8-10 per step) with method "scan_unrolled".

    craftax and jax.random reach both through module attributes, which are swapped for the duration of
    the trace only (a lock keeps two tracing threads from interleaving the swap); our own scans are
    entered before it. If a JAX version lacks one of them, that one is left as it is.
    """
    if not enabled:
        yield
        return
    import jax._src.numpy as jnp_internal  # what jax.random's choice calls searchsorted through

    with _UNROLL_LOCK:
        orig_scan = jax.lax.scan
        orig_ss = {m: getattr(m, "searchsorted", None) for m in (jnp, jnp_internal)}

        def scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):  # noqa: ANN001, ANN202, ARG001
            return orig_scan(f, init, xs, length, reverse=reverse, unroll=True, **kw)

        def searchsorted_for(orig):  # noqa: ANN001, ANN202
            def searchsorted(a, v, side="left", sorter=None, *, method="scan_unrolled"):  # noqa: ANN001, ANN202
                return orig(a, v, side=side, sorter=sorter, method=method)
            return searchsorted

        jax.lax.scan = scan
        for m, orig in orig_ss.items():
            if orig is not None:
                m.searchsorted = searchsorted_for(orig)
        try:
            yield
        finally:
            jax.lax.scan = orig_scan
            for m, orig in orig_ss.items():
                if orig is not None:
                    m.searchsorted = orig
