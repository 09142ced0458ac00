"""Rule-based reward: `#### <number>` exact match (SkyRL's gsm8k env, itself from veRL's gsm8k reward),
plus an optional format bonus so that small models get a signal before they get answers right."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Sequence

from thinkcraft.envs.textenvs.base import Problem, RewardResult

# veRL/SkyRL: "#### (\-?[0-9\.\,]+)"; we also accept "$" and take the last match (models restate the format)
_HASH_RE = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_hash_answer(text: str) -> str | None:
    """The number after the last `####`, commas removed; None when there is none."""
    found = _HASH_RE.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "")


_NUMBER_RE = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_last_number(text: str) -> str | None:
    """The last number in the text (commas removed): a lenient fallback for models that skip the format."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def normalize_number(s: str) -> str | None:
    """Canonical decimal string ("1,000.50" -> "1000.5", "7.0" -> "7"); None if not a number."""
    try:
        d = Decimal(s.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    d = d.normalize()
    out = format(d, "f")
    return "0" if out in ("-0", "0") else out


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    na, nb = normalize_number(a), normalize_number(b)
    return na is not None and na == nb


class RuleReward:
    """reward = answer_weight · [answer == gold] + format_weight · [a `#### <number>` line is present].

    `lenient`: without a `####` line, the last number in the text is taken as the answer (a denser signal
    for small models; the format bonus still rewards the strict form).
    """

    def __init__(self, answer_weight: float = 1.0, format_weight: float = 0.0, lenient: bool = False) -> None:
        self.answer_weight = answer_weight
        self.format_weight = format_weight
        self.lenient = lenient
        self._n = 0
        self._n_format = 0

    def __call__(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]:
        out = []
        for p, c in zip(problems, completions, strict=True):
            pred = extract_hash_answer(c)
            ok = pred is not None
            if pred is None and self.lenient:
                pred = extract_last_number(c)
            correct = numbers_equal(pred, p.answer)
            r = self.answer_weight * float(correct) + self.format_weight * float(ok)
            out.append(RewardResult(reward=r, correct=correct, format_ok=ok, predicted=pred))
            self._n += 1
            self._n_format += ok
        return out

    def counters(self) -> dict[str, float]:
        return {"reward/rule_calls": float(self._n)}
