"""Typed contracts shared by the tasks and their rewards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    """Gold final answer, normalised (e.g. "42", "-3.5")."""
    solution: str = ""
    """Worked solution when the source has one (GSM8K), for judges and inspection."""
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool
    format_ok: bool
    """The completion had a parsable final answer (`#### <number>`; for a judge: a parsable verdict)."""
    predicted: str | None = None


@runtime_checkable
class Task(Protocol):
    name: str
    instructions: str
    """System-prompt text telling the model how to answer (the answer format the reward expects)."""

    def problem(self, seed: int) -> Problem: ...


class RewardFn(Protocol):
    def __call__(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]: ...

    def counters(self) -> dict[str, float]:
        """Running counters to log (e.g. judge verdicts that could not be parsed)."""
        ...
