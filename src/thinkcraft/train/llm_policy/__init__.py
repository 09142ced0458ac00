"""`thinkcraft train llm-policy`: the language model itself is the policy, trained online from env reward.

One synchronous step (each phase timed, `timing/<phase>`):

    1. generate  prompts (chat template, last K turns of history) -> engine.generate (G samples per seed);
                 token ids + sampled-token logprobs kept (token in, token out: never re-tokenized)
    2. env       parse/grade the completions -> per-turn rewards (multi-turn envs loop 1-2 until done)
    3. store     every episode -> trajectory store (token ids, logprobs, masks, rewards, policy_version)
    4. train     returns -> advantages (GRPO / RLOO / REINFORCE) or A*-PO targets -> token loss on generated
                 tokens only, in micro-batches of a token budget packed into dense sequences
                 (varlen attention; packing.py), LM-head log-probs in chunks, gradient accumulation
    5. log/ckpt  metrics, progress, PNG curve; checkpoint (adapter/weights, optimizer, step, RNG)

`timing/rollout` is phases 1-2's wall time with the host's work between them; of it, `timing/records` the turn
records, which the continuous rollout builds between decode steps (while the device computes the next one);
`timing/prompts` (inside `timing/generate`) the next prompts' host work (chat pieces rendered, tokenized).

The learner owns the torch model; the sampler reads the same parameters (no copy), so after step 4 the
next rollout is on-policy with `policy_version = step`.

`--mode async` (async_loop.py, async_build.py, async_run.py on thinkcraft.pools) runs the same phases at
once in three pools - rollouts, rewards, the learner - under a staleness bound `--max-staleness η`; η = 0
gives this loop's samples and updates exactly.
"""

from thinkcraft.pools.contract import Trajectory, TurnRecord
from thinkcraft.train.llm_policy.config import ALGOS_NEEDING_LOGPROBS, Algo, EnvName, LLMPolicyConfig
from thinkcraft.train.llm_policy.learner import (
    Learner, TrainRows, build_rows, checkpoint_state, restore_state, row_scores_and_groups,
)
from thinkcraft.train.llm_policy.loop import run
from thinkcraft.train.llm_policy.model import (
    CHATML_TEMPLATE, check_engine_for_algo, load_policy, make_engine, make_judge, random_model, resolve_model_path,
    train_bpe_tokenizer, trainable,
)
from thinkcraft.train.llm_policy.rollout import (
    _prompt_corpus, _seed_of, _split_think, build_messages, encode_prompt,
    episode_record, make_env_and_reward, rollout,
)

__all__ = [
    "ALGOS_NEEDING_LOGPROBS", "Algo", "CHATML_TEMPLATE", "EnvName", "LLMPolicyConfig", "Learner",
    "TrainRows", "Trajectory", "TurnRecord", "build_messages", "build_rows", "check_engine_for_algo", "checkpoint_state",
    "encode_prompt", "episode_record", "load_policy", "make_engine", "make_env_and_reward", "make_judge",
    "random_model", "resolve_model_path", "restore_state", "rollout", "row_scores_and_groups", "run",
    "train_bpe_tokenizer", "trainable",
    "_prompt_corpus", "_seed_of", "_split_think",  # used by bench/grpo_arith.py (TRL at the same prompts) and tests
]
