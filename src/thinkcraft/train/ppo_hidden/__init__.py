"""`thinkcraft train ppo-hidden`: PPO on Craftax whose policy also reads a frozen LLM's hidden state of the
text observation, refreshed every `skip_n` env steps.

One PPO update of `num_steps` steps per env is a sequence of windows; at each refresh point:

    1. render      extract semantic arrays of every env on the device (jit) → host → compact text (numpy)
    2. llm         engine.hidden_states(shared instruction prefix + per-env text) — the prefix KV is
                   prefilled once and reused; only the per-env suffix is computed → DLPack → JAX (N, H)
    3. norm        running mean/variance update and z-normalisation (rl.hidden)
    4. env_policy  lax.scan of the window's env+policy steps (jit; without --overlap, 3 and 4 are one jitted
                   call timed as env_policy)
and after the last window:
    5. update      the same GAE + PPO update as plain PPO (rl.ppo.ppo_update)

Refresh rule: `skip_n` must divide `num_steps` (windows of skip_n steps inside each update) or be a
multiple of it (one refresh every skip_n/num_steps updates). `skip_n = 0` means "never": the plain PPO
path (`train ppo`) runs, no LLM is loaded.

`--overlap`: the LLM call for a refresh point's snapshot runs in a worker thread while the following
window's env+policy scan runs; the policy then sees hidden states one refresh interval old (schedule.py).
`timing/llm` is then the worker's time (overlapping `timing/env_policy`); `timing/llm_wait` is what the
loop actually waited for it. With the LLM on another GPU (`--engine-device cuda:1`) or a server, the two
overlap without an SM partition.

Modules: config.py (PPOHiddenConfig), source.py (env states -> text -> engine -> JAX (N, H)),
kernels.py (the state and the jitted kernels), schedule.py (synchronous and overlapped refresh), loop.py
(`run`: the outer loop as numbered, timed phases).
"""

from thinkcraft.train.ppo_hidden.config import DEFAULT_INSTRUCTIONS, SHAPE_FIELDS, PPOHiddenConfig
from thinkcraft.train.ppo_hidden.loop import run

__all__ = ["DEFAULT_INSTRUCTIONS", "SHAPE_FIELDS", "PPOHiddenConfig", "run"]
