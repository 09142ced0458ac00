"""Text environments for LLM policies: the multi-turn protocol, Craftax as text, and verifiable tasks.

    env = make_text_env("arith")        # or gsm8k, craftax, craftax-classic
    obs = env.reset(seeds); res = env.step(completions)

- protocol.py: `TextEnv` (reset / step over the active episodes / counters), `StepResult`, `make_text_env`;
- task.py: `TaskEnv`, one turn over a `Task`, graded by a reward function;
- craftax.py: `CraftaxTextEnv`, compact text observations, parsed actions, env rewards;
- jsonformat.py: answers as one JSON object (`action_format="json"`): schemas to constrain decoding to,
  instructions, parsers;
- the tasks and their rewards: a `Task` maps an integer seed to a `Problem` deterministically (so a GRPO
  group of G rollouts of one seed sees the same problem, and a run can be replayed); rewards are batched
  callables `(problems, completions) -> list[RewardResult]`: rule-based (rewards.py, `#### <number>`
  exact match) or an LLM judge through any engine (judge.py).
"""

from thinkcraft.envs.textenvs.base import Problem, RewardFn, RewardResult, Task
from thinkcraft.envs.textenvs.arith import ArithTask
from thinkcraft.envs.textenvs.gsm8k import GSM8KTask, load_gsm8k
from thinkcraft.envs.textenvs.rewards import RuleReward, extract_hash_answer, numbers_equal
from thinkcraft.envs.textenvs.judge import JudgeReward, build_judge_prompt, parse_verdict
from thinkcraft.envs.textenvs.protocol import StepResult, TextEnv, make_text_env
from thinkcraft.envs.textenvs.task import TaskEnv
from thinkcraft.envs.textenvs.craftax import CraftaxTextConfig, CraftaxTextEnv

__all__ = [
    "ArithTask", "CraftaxTextConfig", "CraftaxTextEnv", "GSM8KTask", "JudgeReward", "Problem", "RewardFn",
    "RewardResult", "RuleReward", "StepResult", "Task", "TaskEnv", "TextEnv", "build_judge_prompt",
    "extract_hash_answer", "load_gsm8k", "make_text_env", "numbers_equal", "parse_verdict",
]
