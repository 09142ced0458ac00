"""The layer-free pieces of structured outputs, shared by the engine's constrained decoding
(`llm/constrained.py`), the learner's constrained log-probs (`rl/chunked_logprobs.py`) and the JSON answer
format of the text envs (`envs/textenvs/jsonformat.py`): one JSON layout and one bitmask unpacker."""

from __future__ import annotations

import sys

import torch

JSON_SEPARATORS = (", ", ": ")
"""The one JSON layout constrained answers take (compact, `json.dumps` default separators): no free
whitespace, so a model cannot spend its token budget on blanks."""


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, V) bool of the tokens a (rows, ceil(V/32)) int32 xgrammar bitmask allows (bit j of word w =
    token 32w + j). Unpacked bytewise (a uint8 view of the little-endian words: byte b of word w holds tokens
    32w + 8b ..): one byte per token, never a wider temporary."""
    assert sys.byteorder == "little", "xgrammar bitmasks are unpacked as little-endian words"
    b = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[..., None] >> shifts) & 1).reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()
