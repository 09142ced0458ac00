"""LLM-as-judge reward through any engine: the judge sees the question, the gold answer and the
policy's answer and says CORRECT or INCORRECT. A verdict that cannot be parsed scores 0 and is counted
(`judge/unparsed`); it never crashes a run."""

from __future__ import annotations

import json
import re
from typing import Callable, Sequence

from thinkcraft.envs.textenvs.base import Problem, RewardResult
from thinkcraft.envs.textenvs.rewards import extract_hash_answer
from thinkcraft.llm.protocol import Batch, Engine, SamplingParams

JUDGE_TEMPLATE = """You are grading a student's answer to a math problem.

Problem:
{question}

Reference answer: {gold}

Student's answer: {predicted}

Is the student's final answer equal to the reference answer? Reply with exactly one word: CORRECT or INCORRECT."""

_MAX_PREDICTED_CHARS = 600

_NEG = r"(?:incorrect|not\s+correct|wrong|not\s+equal|false|no)"
_POS = r"(?:correct|right|equal|true|yes)"
_WORD = re.compile(rf"\b(?P<neg>{_NEG})\b|\b(?P<pos>{_POS})\b", re.IGNORECASE)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.IGNORECASE | re.DOTALL)


def build_judge_prompt(problem: Problem, completion: str) -> str:
    pred = extract_hash_answer(completion)
    predicted = pred if pred is not None else completion.strip()[-_MAX_PREDICTED_CHARS:] or "(empty)"
    return JUDGE_TEMPLATE.format(question=problem.question, gold=problem.answer, predicted=predicted)


def parse_verdict(text: str) -> bool | None:
    """True/False from a judge's reply; None when it says nothing usable.

    Order: JSON ({"correct": true} / {"verdict": "..."}), an explicit `VERDICT:` line, a lone 1/0,
    else the *last* verdict word (judges often restate the question before concluding), with
    "incorrect"/"not correct" taking precedence over the "correct" inside them.
    """
    if not isinstance(text, str):
        return None
    t = _THINK.sub(" ", text).strip()
    if not t:
        return None
    for m in re.finditer(r"\{[^{}]*\}", t):
        try:
            obj = json.loads(m.group(0))
        except (json.JSONDecodeError, ValueError):
            continue
        for key in ("correct", "is_correct", "verdict", "answer"):
            if key in obj:
                v = obj[key]
                if isinstance(v, bool):
                    return v
                if isinstance(v, str):
                    got = parse_verdict(v)
                    if got is not None:
                        return got
    m = re.search(r"verdict\s*[:=]\s*\**\s*(\w+(?:\s+\w+)?)", t, re.IGNORECASE)
    if m:
        got = _last_word_verdict(m.group(1))
        if got is not None:
            return got
    if t in ("1", "0"):
        return t == "1"
    return _last_word_verdict(t)


def _last_word_verdict(t: str) -> bool | None:
    last = None
    for m in _WORD.finditer(t):
        last = m
    if last is None:
        return None
    return last.group("pos") is not None


class JudgeReward:
    """reward = answer_weight · [judge says CORRECT] + format_weight · [the completion has `#### <number>`].

    `format_prompt` turns the judge prompt into the engine's input text (e.g. a chat template);
    identity by default.
    """

    def __init__(
        self,
        engine: Engine,
        sampling: SamplingParams | None = None,
        answer_weight: float = 1.0,
        format_weight: float = 0.0,
        format_prompt: Callable[[str], str] | None = None,
    ) -> None:
        self.engine = engine
        self.sampling = sampling or SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=False)
        self.answer_weight = answer_weight
        self.format_weight = format_weight
        self.format_prompt = format_prompt or (lambda s: s)
        self._calls = 0
        self._unparsed = 0
        self._correct = 0

    def __call__(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]:
        prompts = [self.format_prompt(build_judge_prompt(p, c)) for p, c in zip(problems, completions, strict=True)]
        if not prompts:
            return []
        replies = self.engine.generate(Batch(items=prompts), self.sampling)
        out = []
        for c, reply in zip(completions, replies, strict=True):
            verdict = parse_verdict(reply.text)
            self._calls += 1
            if verdict is None:
                self._unparsed += 1
            correct = bool(verdict)
            self._correct += correct
            pred = extract_hash_answer(c)
            r = self.answer_weight * float(correct) + self.format_weight * float(pred is not None)
            out.append(RewardResult(reward=r, correct=correct, format_ok=pred is not None, predicted=pred))
        return out

    def counters(self) -> dict[str, float]:
        return {
            "judge/calls": float(self._calls),
            "judge/unparsed": float(self._unparsed),
            "judge/unparsed_rate": self._unparsed / max(self._calls, 1),
        }
