"""The `####` rule reward grades numerically equal answers as equal in the forms GSM8K graders accept, and
refuses the forms documented as rejected in envs/textenvs/rewards.py (a table of both)."""

from __future__ import annotations

import pytest

from thinkcraft.envs.textenvs import RuleReward
from thinkcraft.envs.textenvs.base import Problem
from thinkcraft.envs.textenvs.rewards import extract_hash_answer, extract_last_number, normalize_number

# (completion's final line, gold answer): graded correct
ACCEPTED = [
    ("#### 5", "5"),
    ("#### $5", "5"),
    ("#### -$5", "-5"),
    ("#### $-5", "-5"),
    ("#### - $ 5", "-5"),
    ("#### \\$5", "5"),
    ("#### \\$-5", "-5"),
    ("#### €12", "12"),
    ("#### £-3", "-3"),
    ("#### +5", "5"),
    ("#### \u22125", "-5"),          # unicode minus
    ("#### $\u22125", "-5"),
    ("#### 1,000", "1000"),
    ("#### 12,345,678", "12345678"),
    ("#### $1,000.50", "1000.5"),
    ("#### 5.00", "5"),
    ("#### 5.", "5"),
    ("#### 5.50", "5.5"),
    ("#### 007", "7"),
    ("#### .5", "0.5"),
    ("#### -0", "0"),
    ("#### **5**", "5"),
    ("#### **-$5**", "-5"),
    ("#### -**5**", "-5"),
    ("#### \\boxed{5}", "5"),
    ("#### $\\boxed{5}$", "5"),
    ("#### \\boxed{-1,000}", "-1000"),
    ("#### $5$", "5"),
    ("#### \\(5\\)", "5"),
    ("#### \\textbf{42}", "42"),
    ("#### 18 dollars", "18"),
    ("#### 50%", "50"),
    ("#### 5.", "5.0"),
    ("#### 3 eggs each", "3"),
    ("so 3+4=7\n#### 7", "7"),
    ("#### 2 ... wait, #### 5", "5"),  # the last #### counts
]

# graded as no answer (hence wrong), each for the reason in the module docstring
REJECTED = [
    "#### 1,5",        # decimal comma or typo
    "#### 1,00",       # not groups of three
    "#### 3/4",        # a fraction: its first number would be a guess
    "#### 3 / 4",
    "#### 3:30",       # a time
    "#### 5e3",        # scientific notation
    "#### 1.2.3",      # a version or a date
    "#### --5",        # two signs
    "#### -$-5",
    "#### +-5",
    "#### five",       # number words
    "#### 1 000",      # spaces inside a number
    "#### \u20135",    # en dash is not a minus
    "#### \u20145",    # em dash
    "#### The answer is 5",  # text between #### and the number
    "the answer is 5",       # no #### at all (strict mode)
]


@pytest.mark.parametrize("completion,gold", ACCEPTED)
def test_accepted_forms(completion: str, gold: str) -> None:
    r = RuleReward()([Problem("q", normalize_number(gold))], [completion])[0]
    assert r.correct and r.format_ok and r.reward == 1.0, (completion, r.predicted)


@pytest.mark.parametrize("completion", REJECTED)
def test_rejected_forms(completion: str) -> None:
    assert extract_hash_answer(completion) is None
    gold = "5" if "5" in completion else "1000"
    r = RuleReward()([Problem("q", gold)], [completion])[0]
    assert not r.correct and not r.format_ok and r.reward == 0.0


def test_a_rejected_form_never_matches_its_first_number() -> None:
    # the danger the rejections guard against: "#### 3/4" graded equal to a gold of 3
    for text, first in (("#### 3/4", "3"), ("#### 1,5", "1"), ("#### 5e3", "5"), ("#### 3:30", "3")):
        assert not RuleReward()([Problem("q", first)], [text])[0].correct


@pytest.mark.parametrize("text,number", [
    ("I think it is 5.", "5"), ("It costs $-3.50 in all", "-3.50"), ("from 2 to 1,000", "1000"),
    ("x2 y", None), ("the result is 1,5", None), ("\\boxed{42}", "42"), ("\u22127 degrees", "-7"),
])
def test_lenient_last_number(text: str, number: str | None) -> None:
    assert extract_last_number(text) == number


def test_lenient_reward_and_format_bonus() -> None:
    rew = RuleReward(answer_weight=1.0, format_weight=0.1, lenient=True)
    r = rew([Problem("q", "42"), Problem("q", "42")], ["so the answer is $42.", "#### 42.00"])
    assert (r[0].correct, r[0].format_ok, r[0].reward) == (True, False, 1.0)
    assert (r[1].correct, r[1].format_ok, r[1].reward) == (True, True, 1.1)


@pytest.mark.parametrize("s,norm", [
    ("1,000.50", "1000.5"), ("7.0", "7"), ("-0.0", "0"), ("$-3", "-3"), ("\u22123", "-3"), ("**5**", "5"),
    ("1,5", None), ("x", None), ("", None), ("3/4", None), ("5 6", None),
])
def test_normalize_number(s: str, norm: str | None) -> None:
    assert normalize_number(s) == norm
