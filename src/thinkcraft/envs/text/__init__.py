"""Text observations for Craftax and Craftax-Classic, for every env at once.

    sem = extract(states)                 # jitted, vmapped: small int arrays, on the states' device
    texts = render(jax.device_get(sem), fmt="compact")   # vectorised numpy on the host
    action = parse_action(reply, "craftax")              # None when the reply has no valid action

Formats: `compact` (short, for LLMs; convention in COMPACT_FORMAT_DOC) and `craftax`
(byte-identical to craftax's `render_craftax_text` for Craftax; the same layout for Classic).
"""

from __future__ import annotations

from typing import Any

import jax

from thinkcraft.envs.text.actions import action_names, action_prompt, parse_action
from thinkcraft.envs.text.render import COMPACT_FORMAT_DOC, FORMATS, CompactTokenRenderer, check_format, render
from thinkcraft.envs.text.semantic import Semantic, env_kind_of, extract


def render_states(states: Any, fmt: str = "compact", batched: bool = True) -> list[str]:
    """extract + device_get + render: text for a batch of (possibly wrapped) env states."""
    check_format(fmt)
    kind = env_kind_of(states)
    return render(jax.device_get(extract(states, batched=batched)), fmt=fmt, env_kind=kind)


__all__ = [
    "COMPACT_FORMAT_DOC",
    "CompactTokenRenderer",
    "FORMATS",
    "Semantic",
    "action_names",
    "action_prompt",
    "env_kind_of",
    "extract",
    "parse_action",
    "render",
    "render_states",
]
