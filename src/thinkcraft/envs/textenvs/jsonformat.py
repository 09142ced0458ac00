"""JSON answers (`train llm-policy --action-format json`): the schema a turn's completion is constrained to,
the instructions that describe it, and the parser the envs read it with.

Decoding is constrained to the schema (llm/constrained.py, xgrammar), so a finished answer always parses;
what can still fail is an answer cut by `max_new_tokens` (the llm-policy config checks that the budget holds
the longest answer: `max_answer_tokens`) or a thought that never closed - both counted as invalid, as before.

- Craftax: `{"reason": "<at most N characters>", "action": "<one of the env's action names>"}`;
- arith / gsm8k: `{"reason": "<at most N characters>", "answer": <integer>}`.

The reason is there only for N > 0 (`--action-reason-chars`), and first: the model writes why before what.
It is printable ASCII without quotes, backslashes or angle brackets: no escapes (one character = one byte,
so an answer's length in tokens is bounded) and no `<think>` tag inside an answer (the engine would count
it as a thought). The answer is an integer of at most ANSWER_DIGITS digits: a JSON number is unbounded (a
model could write digits until the token budget ends), and GSM8K's and arith's gold answers are integers.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Sequence

ActionFormat = Literal["free", "json"]
ACTION_FORMATS = ("free", "json")
REASON_KEY = "reason"
ACTION_KEY = "action"
ANSWER_KEY = "answer"
ANSWER_DIGITS = 12
_REASON_CHAR = r"[ !#-;=?-\[\]-~]"
"""Printable ASCII (0x20-0x7E) but `"`, `\\`, `<` and `>`."""


def _object(key: str, value: dict[str, Any], reason_chars: int) -> dict[str, Any]:
    props: dict[str, Any] = {}
    if reason_chars > 0:
        props[REASON_KEY] = {"type": "string", "pattern": f"^{_REASON_CHAR}{{0,{int(reason_chars)}}}$"}
    props[key] = value
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def action_schema(names: Sequence[str], reason_chars: int = 0) -> dict[str, Any]:
    """`{["reason": str,] "action": one of names}`."""
    return _object(ACTION_KEY, {"type": "string", "enum": list(names)}, reason_chars)


def answer_schema(reason_chars: int = 0) -> dict[str, Any]:
    """`{["reason": str,] "answer": integer}` (at most ANSWER_DIGITS digits)."""
    bound = 10**ANSWER_DIGITS - 1
    return _object(ANSWER_KEY, {"type": "integer", "minimum": -bound, "maximum": bound}, reason_chars)


def max_answer_tokens(names: Sequence[str] | None, reason_chars: int) -> int:
    """Tokens the longest answer can take: its bytes (a token is at least one byte) plus the stop token.
    `names`: the action names (None: a number answer)."""
    from thinkcraft.utils.structured import JSON_SEPARATORS

    value: Any = max(names, key=len) if names is not None else -(10**ANSWER_DIGITS - 1)
    key = ACTION_KEY if names is not None else ANSWER_KEY
    longest = {REASON_KEY: "x" * reason_chars, key: value} if reason_chars > 0 else {key: value}
    return len(json.dumps(longest, separators=JSON_SEPARATORS).encode()) + 1


def _example(key: str, value: Any, reason: str, reason_chars: int) -> str:
    obj = {REASON_KEY: reason[:reason_chars], key: value} if reason_chars > 0 else {key: value}
    return json.dumps(obj)


def action_instructions(reason_chars: int) -> str:
    """How a Craftax turn answers in the JSON format (after the action list)."""
    shape = f'{{"{ACTION_KEY}": "<action name>"}}'
    if reason_chars > 0:
        shape = f'{{"{REASON_KEY}": "<why, at most {reason_chars} characters>", "{ACTION_KEY}": "<action name>"}}'
    return (f"Answer with one JSON object and nothing else: {shape}, e.g. "
            f"{_example(ACTION_KEY, 'do', 'a tree is in front of me', reason_chars)}.")


def answer_instructions(reason_chars: int) -> str:
    """System prompt of arith / gsm8k in the JSON format."""
    shape = f'{{"{ANSWER_KEY}": <integer>}}'
    if reason_chars > 0:
        shape = f'{{"{REASON_KEY}": "<brief working, at most {reason_chars} characters>", "{ANSWER_KEY}": <integer>}}'
    return ("Solve the math problem. Answer with one JSON object and nothing else: "
            f"{shape}, e.g. {_example(ANSWER_KEY, 5, '3 + 2 = 5', reason_chars)}.")


def parse_answer(text: str, key: str) -> tuple[Any, str] | None:
    """(value of `key`, reason or "") of the JSON object a completion answers with (after its thought: the
    text after the last `</think>`); None when that is not exactly one JSON object holding `key`."""
    tail = text.rpartition("</think>")[2].strip()
    if not tail.startswith("{"):
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(tail)
    except ValueError:
        return None
    if not isinstance(obj, dict) or key not in obj or tail[end:].strip():
        return None
    reason = obj.get(REASON_KEY, "")
    return obj[key], reason if isinstance(reason, str) else ""


def parse_action_json(text: str, names: Sequence[str]) -> int | None:
    """The action index of a JSON answer (an exact action name); None when invalid."""
    got = parse_answer(text, ACTION_KEY)
    if got is None or not isinstance(got[0], str) or got[0] not in names:
        return None
    return list(names).index(got[0])


def answer_as_hash_line(text: str) -> str:
    """A JSON number answer rewritten as the free format the rewards grade (`<reason>\\n#### <n>`); "" when it
    does not parse (no answer: the reward counts it invalid)."""
    got = parse_answer(text, ANSWER_KEY)
    if got is None or isinstance(got[0], bool) or not isinstance(got[0], (int, float)):
        return ""
    value, reason = got
    return f"{reason}\n#### {value}"
