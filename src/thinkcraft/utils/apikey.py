"""API keys from an environment variable or a file, so that they need not be on the command line (where
`ps` and shell history show them to everyone on the machine).

One resolver for every command that takes a key (`serve`, `label` endpoint files, `train llm-policy`'s
HTTP judge): at most one source; an unset/empty variable or a missing/empty file is an error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

from thinkcraft.utils.errors import ConfigError, UserError


def resolve_api_key(key: str | None = None, env: str | None = None, file: str | os.PathLike | None = None,
                    names: tuple[str, str, str] = ("api_key", "api_key_env", "api_key_file")) -> str | None:
    """The key given inline, read from the variable `env`, or from the first line of `file` (surrounding
    whitespace stripped); None when no source is given. `names` are the caller's names of the three
    sources, for the messages. Raises UserError on two sources, an unset variable, an unreadable file."""
    given = [n for n, v in zip(names, (key, env, file)) if v]
    if len(given) > 1:
        raise UserError(f"give one of {' / '.join(given)}, not several")
    if key:
        return key
    if env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise UserError(f"{names[1]}: environment variable {env} is not set (or empty)")
        return value
    if file:
        path = Path(file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").strip().splitlines()
        except OSError as e:
            raise UserError(f"{names[2]}: cannot read {path} ({e.strerror or e})") from None
        if not lines or not lines[0].strip():
            raise UserError(f"{names[2]}: {path} is empty")
        return lines[0].strip()
    return None


def resolve_config_key(key: str | None, env: str | None, file: str | os.PathLike | None,
                       names: tuple[str, str, str] = ("api_key", "api_key_env", "api_key_file")) -> str | None:
    """`resolve_api_key` for a command's config: a failure is a ConfigError naming the field at fault."""
    try:
        return resolve_api_key(key, env, file, names)
    except UserError as e:
        field, _, msg = str(e).partition(": ")
        raise ConfigError(field if field in names else names[0], msg or str(e)) from None
