"""Action names, a prompt-ready action list, and a tolerant parser from LLM output to an action index."""

from __future__ import annotations

import functools
import re

from thinkcraft.envs import craftax as craftax_envs
from thinkcraft.envs.text.names import ACTION_NAMES

# what the movement actions do, for the prompt (craftax: "left" moves/faces west = col - 1)
_HINTS = {
    "noop": "do nothing",
    "left": "move or face west, col -1",
    "right": "move or face east, col +1",
    "up": "move or face north, row -1",
    "down": "move or face south, row +1",
    "do": "interact with the facing tile: collect, attack, drink, eat",
    "sleep": "restores energy",
}


def action_names(env_kind: str) -> tuple[str, ...]:
    """Canonical lower-case action names, index = action id (43 for Craftax, 17 for Classic)."""
    return ACTION_NAMES[craftax_envs.env_kind(env_kind)]


ANSWER_LINE = "End your reply with one line `Action: <number or name>`, e.g. `Action: 5` or `Action: do`."


def action_prompt(env_kind: str, how_to_answer: str = ANSWER_LINE) -> str:
    """Numbered action list for an LLM prompt, plus how to answer (default: the `Action: ...` line that
    `parse_action` reads)."""
    lines = [
        f"{i}: {name}" + (f" ({_HINTS[name]})" if name in _HINTS else "")
        for i, name in enumerate(action_names(env_kind))
    ]
    return "Actions:\n" + "\n".join(lines) + "\n" + how_to_answer


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@functools.lru_cache(maxsize=None)
def _name_index(kind: str) -> dict[str, int]:
    table = {name: i for i, name in enumerate(ACTION_NAMES[kind])}
    # tolerated spellings: no underscores ("placetable"), "noop" variants
    table.update({name.replace("_", ""): i for name, i in list(table.items())})
    table.update({"no_op": 0, "nothing": 0, "wait": 0})
    return table


# "Action" (any case, markdown ** or backticks around), then ":" / "=" (an explicit answer) or
# " is " (prose, weaker), then the answer
_ANSWER = re.compile(
    r"action[*`_ ]{0,4}(?:(?P<colon>[:=])|\s+is\b)[*`\"' ]{0,4}(?P<answer>[A-Za-z0-9_ \-]{1,40})",
    re.IGNORECASE,
)


def _resolve(answer: str, kind: str, num_actions: int) -> int | None:
    """Index of one answer fragment: a number first, else the longest action-name prefix."""
    answer = answer.strip()
    m = re.match(r"(\d+)\b", answer)
    if m:
        i = int(m.group(1))
        return i if i < num_actions else None
    words = _norm(answer).split("_")
    index = _name_index(kind)
    for k in range(len(words), 0, -1):  # "place table now" -> "place_table"
        for cand in ("_".join(words[:k]), "".join(words[:k])):
            if cand in index:
                return index[cand]
    return None


def parse_action(text: str, env_kind: str) -> int | None:
    """Action index from an LLM reply; None when there is no valid answer (count these).

    Accepts `Action: 5`, `Action: place_table`, `**Action:** 12 (DO)`, `action = Place Table`,
    any case and punctuation around them; the last `Action` answer wins (so a model that
    reconsiders is taken at its final word). A reply that is only a number or an action name
    also counts. Anything else -> None.
    """
    kind = craftax_envs.env_kind(env_kind)
    num_actions = len(ACTION_NAMES[kind])
    for m in reversed(list(_ANSWER.finditer(text))):
        got = _resolve(m.group("answer"), kind, num_actions)
        if got is not None:
            return got
        if m.group("colon"):  # an explicit "Action: <junk>" is the model's last word: invalid
            return None
        # "this action is great": prose, keep looking further back
    bare = text.strip().strip("`*.\"' \n")
    if re.fullmatch(r"\d+", bare):
        i = int(bare)
        return i if i < num_actions else None
    return _name_index(kind).get(_norm(bare))
