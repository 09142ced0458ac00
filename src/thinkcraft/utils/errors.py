"""User-facing errors: the CLI prints these as one clear message (no traceback) and exits 2."""

from __future__ import annotations

from typing import Callable


class UserError(Exception):
    """Bad input the user can fix (config, files, missing model/engine). Message says what to change."""


class ConfigError(UserError):
    """An invalid config field; raised from `__post_init__`/`validate()` before anything compiles."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"--{field.replace('_', '-')}: {message}")


def check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


def env_switch(name: str, default: bool = False) -> bool:
    """A switch read from the environment: "1" on, "0" off, unset (or empty) `default`, anything else a clear
    error."""
    import os

    v = os.environ.get(name, "").strip() or ("1" if default else "0")
    if v not in ("0", "1"):
        raise UserError(f"{name} must be 0 or 1, got {v!r}")
    return v == "1"


def env_int(name: str, default: int, least: int = 0, most: int | None = None,
            check: Callable[[int], bool] | None = None, wanted: str | None = None) -> int:
    """A whole number read from the environment: unset (or empty) `default`, else an integer from `least` to `most`
    (None: no upper bound) for which `check` (if given) holds; anything else a clear error, saying `wanted` (default:
    the range)."""
    import os

    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < least or (most is not None and n > most) or (check is not None and not check(n)):
        if wanted is None:
            wanted = f"an integer from {least} to {most}" if most is not None else f"a whole number >= {least}"
        raise UserError(f"{name} must be {wanted}, got {v!r}")
    return n
