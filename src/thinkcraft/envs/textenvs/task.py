"""Single-turn text envs over a verifiable task (arith, gsm8k): one question, one graded answer."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from thinkcraft.utils.errors import UserError

from thinkcraft.envs.textenvs import jsonformat
from thinkcraft.envs.textenvs.base import Problem, RewardFn, Task
from thinkcraft.envs.textenvs.protocol import StepResult, check_len, stepped_indices


class TaskEnv:
    """One question, one answer, graded by `reward_fn`; every episode ends after its first step."""

    max_turns = 1

    def __init__(self, task: Task, reward_fn: RewardFn, action_format: str = "free", reason_chars: int = 0) -> None:
        if action_format not in jsonformat.ACTION_FORMATS:
            raise UserError(f"unknown action format {action_format!r}: use free or json")
        self.task = task
        self.reward_fn = reward_fn
        self.name = task.name
        self.system_prompt = task.instructions
        self.answer_schema = None
        """The JSON schema every completion is constrained to (json format: `{"answer": <integer>}`), else None.
        Its answers reach the reward as `<reason>\n#### <n>` (`jsonformat.answer_as_hash_line`)."""
        if action_format == "json":
            self.answer_schema = jsonformat.answer_schema(reason_chars)
            self.system_prompt = jsonformat.answer_instructions(reason_chars)
        self.problems: list[Problem] = []
        self._active: list[int] = []
        self._num_invalid = 0
        self._num_answers = 0

    def reset(self, seeds: Sequence[int]) -> list[str]:
        self.problems = [self.task.problem(int(s)) for s in seeds]
        self._active = list(range(len(seeds)))
        return [p.question for p in self.problems]

    def active_indices(self) -> list[int]:
        return list(self._active)

    def step(self, actions_text: Sequence[str], indices: Sequence[int] | None = None) -> StepResult:
        stepped = stepped_indices(self._active, indices)
        check_len(actions_text, stepped)
        probs = [self.problems[i] for i in stepped]
        texts = list(actions_text)
        if self.answer_schema is not None:
            texts = [jsonformat.answer_as_hash_line(t) for t in texts]
        results = self.reward_fn(probs, texts)
        n = len(results)
        self._num_answers += n
        self._num_invalid += sum(not r.format_ok for r in results)
        infos = [
            {"correct": r.correct, "format_ok": r.format_ok, "invalid": not r.format_ok, "predicted": r.predicted,
             "gold": p.answer}
            for r, p in zip(results, probs)
        ]
        gone = set(stepped)
        self._active = [i for i in self._active if i not in gone]
        return StepResult(
            observations=[""] * n,
            rewards=np.array([r.reward for r in results], dtype=np.float32),
            terminated=np.ones(n, dtype=bool),
            truncated=np.zeros(n, dtype=bool),
            infos=infos,
        )

    def counters(self) -> dict[str, float]:
        out = {"format/invalid": float(self._num_invalid), "format/answers": float(self._num_answers)}
        out.update(self.reward_fn.counters())
        return out
