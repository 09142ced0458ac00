"""Verifiable text tasks for the LLM policy: problems with a gold answer and reward functions.

A `Task` maps an integer seed to a `Problem` deterministically (so a GRPO group of G rollouts of one seed
sees the same problem, and a run can be replayed). Rewards are batched callables
`(problems, completions) -> list[RewardResult]`: rule-based (`#### <number>` exact match) or an
LLM judge through any engine.
"""

from thinkcraft.envs.tasks.base import Problem, RewardFn, RewardResult, Task
from thinkcraft.envs.tasks.arith import ArithTask
from thinkcraft.envs.tasks.gsm8k import GSM8KTask, load_gsm8k
from thinkcraft.envs.tasks.rewards import RuleReward, extract_hash_answer, numbers_equal
from thinkcraft.envs.tasks.judge import JudgeReward, build_judge_prompt, parse_verdict

__all__ = [
    "ArithTask", "GSM8KTask", "JudgeReward", "Problem", "RewardFn", "RewardResult", "RuleReward", "Task",
    "build_judge_prompt", "extract_hash_answer", "load_gsm8k", "numbers_equal", "parse_verdict",
]
