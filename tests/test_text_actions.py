"""Action names, prompt and the LLM-output parser on a table of real-looking replies."""

from __future__ import annotations

import pytest
from craftax.craftax.constants import Action
from craftax.craftax_classic.constants import Action as ClassicAction

from thinkcraft.envs.text import action_names, action_prompt, parse_action
from thinkcraft.utils.errors import UserError


def test_names_match_craftax():
    names = action_names("craftax")
    assert len(names) == 43 and names[0] == "noop" and names[8] == "place_table" and names[42] == "enchant_bow"
    assert names == tuple(a.name.lower() for a in Action)
    classic = action_names("Craftax-Classic-Symbolic-v1")
    assert len(classic) == 17 and classic == tuple(a.name.lower() for a in ClassicAction)


def test_prompt_lists_every_action():
    prompt = action_prompt("craftax-classic")
    for i, name in enumerate(action_names("craftax-classic")):
        assert f"\n{i}: {name}" in prompt
    assert "Action:" in prompt and "west" in prompt


CASES = [
    # (reply, craftax action or None)
    ("Action: 5", 5),
    ("Action: place_table", 8),
    ("**Action:** 12 (DO)", 12),  # the number wins over the name in brackets
    ("action: PLACE TABLE", 8),
    ("ACTION=11", 11),
    ("Final action: sleep", 6),
    ("**Action**: `do`", 5),
    ("**Action: 8**", 8),
    ("Action: Make Wood Pickaxe!", 11),
    ("Action: make-stone-sword.", 15),
    ("Action: placetable", 8),
    ("The tree is north of me, so I should face up first.\nAction: up", 3),
    ("I think... Action: 3\nWait, there is a zombie. Action: 4", 4),  # the last answer wins
    ("<think>Action: 1 looks good</think>\nAction: noop", 0),
    ("Action: 5. This action is the best one.", 5),  # prose after the answer does not override it
    ("The best action is do.", 5),
    ("5", 5),
    ("  `place_table`  ", 8),
    ("Action: 43", None),  # out of range for Craftax
    ("Action: 99", None),
    ("Action: banana", None),
    ("Action: 3\nAction: fly", None),  # the final answer is invalid
    ("I am not sure what to do.", None),
    ("", None),
    ("Let me move left.", None),  # no answer line
]


@pytest.mark.parametrize("reply,expected", CASES)
def test_parse_action_table(reply, expected):
    assert parse_action(reply, "craftax") == expected


def test_parse_action_classic_range_and_bad_env():
    assert parse_action("Action: 16", "craftax-classic") == 16
    assert parse_action("Action: 17", "craftax-classic") is None
    assert parse_action("Action: descend", "craftax-classic") is None  # not a Classic action
    assert parse_action("Action: descend", "craftax") == 18
    with pytest.raises(UserError, match="craftax-classic"):
        parse_action("Action: 1", "minecraft")
