"""Craftax as a multi-turn text env for LLM policies (compact observations, parsed actions)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from thinkcraft.envs.textenvs import jsonformat
from thinkcraft.envs.textenvs.protocol import StepResult, check_len, stepped_indices
from thinkcraft.utils.errors import UserError, env_switch

# XLA's command buffers for every op kind, graphs of any size (THINKCRAFT_ENV_CMDBUF=1; the XLA_FLAGS spelling of
# bench/queues.sh's craftax30 set, per jit).
_COMMAND_BUFFER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION",
    "xla_gpu_graph_min_graph_size": 1,
}


@dataclass(frozen=True)
class CraftaxTextConfig:
    env_kind: str = "craftax-classic"
    """'craftax' (Craftax-Symbolic) or 'craftax-classic'."""
    max_steps: int = 32
    """Episode step cap (truncation): LLM decisions are expensive, episodes are cut short."""
    format_penalty: float = 0.0
    """Subtracted from the reward of a turn whose action could not be parsed (a no-op is played)."""
    action_format: str = "free"
    """free (`Action: <name>` anywhere in the reply) or json (one JSON object, `jsonformat.action_schema`)."""
    reason_chars: int = 0
    """json: a reason string of at most this many characters before the action (0 = none)."""
    unroll_env_scans: str = "auto"
    """auto | on | off: trace Craftax's short inner loops and random.choice's binary searches unrolled in the
    step and reset (envs/unroll.py; the same states). On a GPU each loop iteration is otherwise driven by the
    host: the text env's step held the device idle ~25 ms of each ~30 ms turn boundary of the 256-env LLM rollout
    (H200, 2026-12-03, py-spy). auto = on when JAX runs on a GPU."""


class CraftaxTextEnv:
    """Craftax with compact text observations (the text package's renderer and action parser).

    All episodes of a reset step together in one jitted, vmapped call; finished episodes keep their
    last state and are stepped with no-ops (masked out), so the compiled batch shape stays fixed.
    """

    def __init__(self, config: CraftaxTextConfig = CraftaxTextConfig()) -> None:
        import os

        # JAX shares the GPU with the torch policy: it must not grab 75% of the memory up front
        # (only effective before JAX's first computation in this process)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax

        from craftax.craftax_env import make_craftax_env_from_name

        from thinkcraft.envs import text as textpkg
        from thinkcraft.envs.text.actions import ANSWER_LINE
        from thinkcraft.envs.craftax import ENV_KINDS, symbolic_env_name

        self.config = config
        self.name = config.env_kind
        self.max_turns = config.max_steps
        self._text = textpkg
        if config.env_kind not in ENV_KINDS:
            raise UserError(f"unknown craftax env kind {config.env_kind!r}: use craftax or craftax-classic")
        self._env = make_craftax_env_from_name(symbolic_env_name(config.env_kind), auto_reset=False)
        self._params = self._env.default_params
        self._noop = int(self._text.parse_action("noop", config.env_kind) or 0)
        game = "Craftax-Classic" if config.env_kind == "craftax-classic" else "Craftax"
        self._names = self._text.action_names(config.env_kind)
        self.answer_schema = None
        """The JSON schema every turn's completion is constrained to (json format), else None."""
        answer = ANSWER_LINE
        if config.action_format == "json":
            self.answer_schema = jsonformat.action_schema(self._names, config.reason_chars)
            answer = jsonformat.action_instructions(config.reason_chars)
        elif config.action_format != "free":
            raise UserError(f"unknown action format {config.action_format!r}: use free or json")
        self.system_prompt = (
            f"You play {game}, a 2D survival and crafting game. Each turn you see the text observation; "
            "think briefly, then choose one action.\n" + self._text.COMPACT_FORMAT_DOC + "\n"
            + self._text.action_prompt(config.env_kind, answer)
        )
        env, params = self._env, self._params
        from thinkcraft.envs.unroll import UNROLL_SETTINGS, resolve_unroll_env_scans, unroll_env_scans

        if config.unroll_env_scans not in UNROLL_SETTINGS:
            raise UserError(f"unroll_env_scans must be one of {', '.join(UNROLL_SETTINGS)}, not "
                            f"{config.unroll_env_scans!r}")
        self.unrolled = resolve_unroll_env_scans(config.unroll_env_scans)  # type: ignore[arg-type]
        unrolled = self.unrolled

        def reset_one(k):  # noqa: ANN001, ANN202 - the context is entered while jit traces (once per shape)
            with unroll_env_scans(unrolled):
                # strong types: reset leaves 24 leaves weakly typed (Python scalars) and the stepped state has
                # them strong, so the second step call compiled the step again (a Craftax-Symbolic step: tens of s)
                return _strong(env.reset(k, params))

        extract = textpkg.extract  # itself jitted: inlined into the calls below
        reset_all = jax.vmap(reset_one)

        def reset_and_extract(seeds):  # noqa: ANN001, ANN202
            split = jax.vmap(jax.random.split)(jax.vmap(jax.random.PRNGKey)(seeds))
            _, state = reset_all(split[:, 1])
            return split[:, 0], state, extract(state, batched=True)

        advance = _masked_step(env, params, unrolled)

        def advance_and_extract(keys, state, actions, keep):  # noqa: ANN001, ANN202
            keys, state, reward, done = advance(keys, state, actions, keep)
            return keys, state, reward, done, extract(state, batched=True)

        # A turn is one compiled call (key split, step, keep-merge, the new states' semantic arrays) and one
        # device->host copy (reward, done, semantics together), a reset likewise: with the text extracted in
        # a second jitted call and fetched by a second device_get, each turn paid two dispatches and two
        # blocking syncs - on an H200 ~17 ms of wall a turn for ~2 ms of kernels, on the LLM rollout's
        # critical path (the GPU idles meanwhile). Still one compile each per batch size.
        # THINKCRAFT_ENV_CMDBUF=1 (GPU only, opt-in): the two calls compiled with XLA's command buffers for every op
        # kind, down to one-op graphs - the step's ~660 kernels replayed as CUDA graphs instead of launched one by one
        # (set globally through XLA_FLAGS it took a 256-env step 25.3 -> 19.1 ms on an H200, 2026-12-04); per jit here
        # so the LLM's own JAX work, if any, is untouched. Opt-in: over the donated step it gained nothing in the
        # rollout (env 0.098 s against 0.091 s a rollout, H100, 2026-12-07, BENCHMARKS §7b).
        self.command_buffers = env_switch("THINKCRAFT_ENV_CMDBUF") and jax.default_backend() == "gpu"
        opts = {"compiler_options": _COMMAND_BUFFER_OPTIONS} if self.command_buffers else {}
        self._reset = jax.jit(reset_and_extract, **opts)
        # The keys and the state are donated: the step writes the new state into the old one's buffers instead of
        # allocating ~the whole state again each turn (nothing else holds the old state: `step` replaces it).
        # The actions and the keep mask go in as numpy arrays: the call's own transfer, no jnp.asarray dispatch
        # each. THINKCRAFT_ENV_DONATE=0 / THINKCRAFT_ENV_NUMPY_INPUTS=0: the step as before 2026-12-07 (A/B).
        self.donates_state = env_switch("THINKCRAFT_ENV_DONATE", default=True)
        self.numpy_inputs = env_switch("THINKCRAFT_ENV_NUMPY_INPUTS", default=True)
        self._advance = jax.jit(advance_and_extract, donate_argnums=(0, 1) if self.donates_state else (), **opts)
        self._jax = jax
        self._state = None
        self._keys = None
        self._t = np.zeros(0, dtype=np.int64)
        self._done = np.zeros(0, dtype=bool)
        self._num_invalid = 0
        self._num_actions = 0
        self._steps = 0
        self._phase_s = dict.fromkeys(("parse", "dispatch", "fetch", "render", "rest"), 0.0)

    def reset(self, seeds: Sequence[int]) -> list[str]:
        jax = self._jax
        import jax.numpy as jnp

        # one call: keys from the seeds, split, reset, the semantic arrays (eagerly, the vmapped PRNGKey and split
        # were dispatches of their own)
        self._keys, self._state, sem = self._reset(jnp.asarray(list(seeds), dtype=jnp.uint32))
        n = len(seeds)
        self._t = np.zeros(n, dtype=np.int64)
        self._done = np.zeros(n, dtype=bool)
        return self._render(jax.device_get(sem), list(range(n)))

    def _render(self, sem, idx: list[int]) -> list[str]:  # noqa: ANN001 - a host-side `Semantic`
        """Compact texts of episodes `idx` from `sem`, the semantic arrays of every episode (small ints, already
        fetched to the host with the step's reward and done): only the wanted rows are rendered (the host
        renderer's cost is per row; the continuous rollout steps a subset at a time)."""
        import jax

        if not idx:
            return []
        n = len(self._done)
        if len(idx) < n:
            rows = np.asarray(idx, dtype=np.int64)
            sem = jax.tree_util.tree_map(lambda x: x[rows] if getattr(x, "ndim", 0) and x.shape[0] == n else x, sem)
        return self._text.render(sem, fmt="compact", env_kind=self.config.env_kind)

    def active_indices(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self._done)]

    def step(self, actions_text: Sequence[str], indices: Sequence[int] | None = None) -> StepResult:
        jax = self._jax
        import jax.numpy as jnp

        t0 = time.perf_counter()
        active = stepped_indices(self.active_indices(), indices)
        check_len(actions_text, active)
        n = len(self._done)
        actions = np.full(n, self._noop, dtype=np.int32)
        invalid = np.zeros(n, dtype=bool)
        json_answers = self.answer_schema is not None
        for i, text in zip(active, actions_text):
            a = (jsonformat.parse_action_json(text, self._names) if json_answers
                 else self._text.parse_action(text, self.config.env_kind))
            if a is None:
                invalid[i] = True
            else:
                actions[i] = a
        self._num_actions += len(active)
        self._num_invalid += int(invalid.sum())
        # finished episodes keep their final state (no auto-reset), and so do the ones not stepped now; only
        # stepped episodes advance their keys (an episode's randomness does not depend on the others' steps)
        still = np.ones(n, dtype=bool)
        still[active] = False
        # one compiled call (key split, step, keep-merge, the new states' semantic arrays): eagerly, the merge
        # alone was a jnp.where per state leaf - ~1 ms each on a CPU, a dispatch each on a GPU - and the
        # un-jitted vmapped split retraced per call; then one device->host copy of all that the host needs
        t1 = time.perf_counter()
        feed = (actions, still) if self.numpy_inputs else (jnp.asarray(actions), jnp.asarray(still))
        self._keys, self._state, reward, done, sem = self._advance(self._keys, self._state, *feed)
        t2 = time.perf_counter()
        reward, done, sem = jax.device_get((reward, done, sem))
        t3 = time.perf_counter()
        reward = np.asarray(reward, dtype=np.float32)
        done = np.asarray(done, dtype=bool)
        self._t[active] += 1
        idx = np.asarray(active, dtype=np.int64)
        terminated = done[idx]
        truncated = (~terminated) & (self._t[idx] >= self.config.max_steps)
        rewards = reward[idx] - self.config.format_penalty * invalid[idx]
        self._done[idx] = terminated | truncated
        t4 = time.perf_counter()
        obs_all = self._render(sem, active)
        t5 = time.perf_counter()
        obs = [o if not (te or tr) else "" for o, te, tr in zip(obs_all, terminated, truncated)]
        infos = [{"action": int(actions[i]), "invalid": bool(invalid[i]), "env_reward": float(reward[i])} for i in active]
        t = self._phase_s
        t["parse"] += t1 - t0
        t["dispatch"] += t2 - t1
        t["fetch"] += t3 - t2
        t["render"] += t5 - t4
        t["rest"] += (t4 - t3) + (time.perf_counter() - t5)
        self._steps += 1
        return StepResult(obs, rewards.astype(np.float32), terminated, truncated, infos)

    def counters(self) -> dict[str, float]:
        """Format counts, and the steps' host time by phase since construction (`env_time/<phase>_s`): parse (the
        actions' texts), dispatch (the compiled call's enqueueing: on a GPU the host launches its kernels),
        fetch (waiting for the device and the copy back), render (the observations' texts), rest."""
        out = {"format/invalid": float(self._num_invalid), "format/answers": float(self._num_actions),
               "env_time/steps": float(self._steps)}
        out.update({f"env_time/{k}_s": v for k, v in self._phase_s.items()})
        return out


def _masked_step(env, params, unrolled: bool = False):
    """(keys, state, actions, keep) -> (keys, state, reward, done) for a batch of episodes: those with `keep`
    set keep their key and state (finished, or not stepped in this call), the others split their key and step
    with its second half - an episode's randomness does not depend on which others step with it. `unrolled`:
    Craftax's inner loops traced unrolled (envs/unroll.py)."""
    import jax
    import jax.numpy as jnp

    from thinkcraft.envs.unroll import unroll_env_scans

    step = jax.vmap(lambda k, s, a: env.step(k, s, a, params))

    def advance(keys, state, actions, keep):
        split = jax.vmap(jax.random.split)(keys)
        with unroll_env_scans(unrolled):  # entered while jit traces
            _, new_state, reward, done, _info = step(split[:, 1], state, actions)
        merged = jax.tree_util.tree_map(
            lambda old, new: jnp.where(keep.reshape((-1,) + (1,) * (new.ndim - 1)), old, new), state, new_state)
        return jnp.where(keep[:, None], keys, split[:, 0]), merged, reward, done

    return advance


def _strong(tree):
    """`tree` with every leaf of its own dtype, strongly typed (`weak_type` off): the compiled step's inputs
    then have one signature, whether the state comes from a reset or a step."""
    import jax

    return jax.tree_util.tree_map(lambda x: jax.lax.convert_element_type(x, x.dtype), tree)
