"""Rule-based reward: the number after `####` (SkyRL's gsm8k env, itself from veRL's gsm8k reward) compared
numerically with the gold answer, plus an optional format bonus so that small models get a signal before
they get answers right.

What counts as the same number — the forms GSM8K graders accept (lm-eval-harness' strict/flexible
extraction, veRL, Qwen-Math's normaliser), each a row of tests/test_rewards.py:
- currency and signs in either order: `$5`, `-$5`, `$-5`, `\\$5`, `€5`, `£5`; an explicit `+5`; the
  unicode minus `−5` (U+2212);
- thousands separators in groups of three: `1,000`, `12,345,678`;
- trailing zeros and a trailing period: `5.00`, `5.`, `5.50` = `5.5`, `007` = `7`, `.5` = `0.5`;
- surrounding bold or LaTeX: `**5**`, `\\boxed{5}`, `$5$`, `\\(5\\)`, `\\textbf{5}`, `$\\boxed{5}$`;
- anything after the number (units, words, `%`, `}`, `**`, a full stop): `#### 18 dollars` = 18.

Deliberately rejected (no answer, hence not correct), because reading them as a number would be a guess:
- a comma not in groups of three (`1,5`, `1,00`): a decimal comma or a typo — 1.5, 15 or 100?
- a fraction, a ratio, a time or scientific notation (`3/4`, `3:30`, `5e3`): taking their first number
  (3, 3, 5) would score a wrong answer as right; GSM8K's gold answers are plain decimals;
- a dotted number such as `1.2.3` (a version or a date);
- two signs (`--5`, `-$-5`, `+-5`), number words (`five`), spaces inside a number (`1 000`);
- a dash that is not a minus (`–5` en dash, `—5` em dash): used as punctuation ("#### — 5").
The `####` must be followed by the (decorated) number; text in between (`#### The answer is 5`) is no
answer — the `lenient` mode then grades the last number in the text instead.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Sequence

from thinkcraft.envs.textenvs.base import Problem, RewardResult

_SIGN = r"[-+\u2212]"
_CURRENCY = r"(?:\\\$|\$|€|£)"
# bold, inline/display math, \boxed{...} and friends, opening braces (closing ones come after the number)
_OPEN = r"(?:\*\*|\*|__|\\\$|\$|\\\(|\\\[|\\boxed\{|\\textbf\{|\\mathbf\{|\\text\{|\{)"
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+"
# what may not follow a number: more of a number (a bad grouping, a second dot, a space-separated group of
# three), a fraction, a time, an exponent
_NOT_AFTER = r"(?!\d|,\d|\.\d|[ \u00a0\u202f]\d{3}(?!\d)|\s*/\s*\d|:\d|[eE][-+]?\d)"
_DECORATED = (
    rf"(?:{_OPEN}[ \t]*)*(?P<s1>{_SIGN})?[ \t]*(?:{_CURRENCY}[ \t]*)?(?:{_OPEN}[ \t]*)*"
    rf"(?P<s2>{_SIGN})?(?P<num>{_NUMBER}){_NOT_AFTER}"
)
_HASH_RE = re.compile(rf"####[ \t]*{_DECORATED}")
_ANY_RE = re.compile(rf"(?<![\w.,]){_DECORATED}")
_FULL_RE = re.compile(rf"\s*{_DECORATED}\s*(?:\}}|\*\*|\*|__|\$|\\\)|\\\]|\.|%)*\s*")


def _signed(m: re.Match) -> str | None:
    """The matched number as plain text (sign as '-', no '+', no separators); None for two signs."""
    s1, s2 = m.group("s1"), m.group("s2")
    if s1 and s2:
        return None
    negative = (s1 or s2 or "+") in ("-", "\u2212")
    num = m.group("num").replace(",", "").rstrip(".")  # "5." is 5 (a full stop, or a bare decimal point)
    return ("-" if negative else "") + num


def extract_hash_answer(text: str) -> str | None:
    """The number after the last `####` (plain text: "-1000.50"); None when there is none."""
    found = list(_HASH_RE.finditer(text))
    return _signed(found[-1]) if found else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text: a lenient fallback for models that skip the format."""
    found = list(_ANY_RE.finditer(text))
    return _signed(found[-1]) if found else None


def normalize_number(s: str) -> str | None:
    """Canonical decimal string ("$1,000.50" -> "1000.5", "7.0" -> "7", "−3" -> "-3"); None if `s` is not
    one number in an accepted form (see the module docstring)."""
    m = _FULL_RE.fullmatch(s)
    plain = _signed(m) if m else None
    if plain is None:
        return None
    try:
        d = Decimal(plain)
    except InvalidOperation:  # pragma: no cover - the grammar only lets decimals through
        return None
    out = format(d.normalize(), "f")
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
