"""Text envs for rollout workers: built from a picklable `EnvSpec`, run in the worker's thread or in a child
process, every call under a timeout.

- `ThreadEnv`: the env in the worker's own process. A call past its timeout is abandoned on a helper
  thread (Python cannot kill a thread): the env is marked broken and rebuilt for the next group; the stuck
  call keeps its thread until it returns. Cheap; right for envs that can be slow but do not hang forever.
- `ProcessEnv`: the env in a child process (spawned, so no torch/JAX state is forked). A call past its
  timeout, or a child that died (killed, segfault), kills the child; the next group starts a fresh one.
  Isolation for envs that may hang or crash the interpreter.

Either raises `EnvFault(reason)` with reason env_step_timeout / env_crashed / env_error; the rollout worker
turns it into a dropped, counted group (`rollout/failed/<reason>`), and the group is played again.

`EnvSpec.latency_ms` injects a sleep into every step (the slow-env benchmark and tests).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence


class EnvFault(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class EnvSpec:
    """Everything needed to build a text env anywhere (a thread, a child process, a Ray actor)."""

    name: str
    difficulty: int = 1
    gsm8k_path: str | None = None
    max_turns: int = 8
    format_penalty: float = 0.0
    reward: Literal["rule", "deferred"] = "rule"
    """rule: the env grades answers itself (RuleReward); deferred: the env only plays, and the reward pool
    grades (a judge): every reward is 0 until then."""
    answer_weight: float = 1.0
    format_weight: float = 0.0
    lenient: bool = False
    latency_ms: float = 0.0
    """Injected latency per env step (ms)."""
    action_format: Literal["free", "json"] = "free"
    """json: answers are one JSON object (the env's `answer_schema`), free: free text."""
    reason_chars: int = 0
    """json answers: the longest reason string (0 = no reason field)."""
    unroll_env_scans: Literal["auto", "on", "off"] = "auto"
    """Craftax: the env's inner loops traced unrolled (envs/unroll.py; auto = on a GPU)."""

    def build(self) -> Any:
        from thinkcraft.envs.textenvs import RuleReward
        from thinkcraft.envs.textenvs import make_text_env

        if self.reward == "rule":
            reward_fn = RuleReward(self.answer_weight, self.format_weight, lenient=self.lenient)
        else:
            reward_fn = RuleReward(0.0, 0.0, lenient=self.lenient)
        env = make_text_env(self.name, reward_fn=reward_fn, difficulty=self.difficulty, gsm8k_path=self.gsm8k_path,
                            max_steps=self.max_turns, format_penalty=self.format_penalty,
                            action_format=self.action_format, reason_chars=self.reason_chars,
                            unroll_env_scans=self.unroll_env_scans)
        return LatencyEnv(env, self.latency_ms) if self.latency_ms > 0 else env


class LatencyEnv:
    """Adds `latency_ms` to every step of the wrapped text env (a slow simulator or a remote sandbox)."""

    def __init__(self, env: Any, latency_ms: float) -> None:
        self.env = env
        self.latency_s = latency_ms / 1000.0
        self.name, self.system_prompt, self.max_turns = env.name, env.system_prompt, env.max_turns

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped env's (e.g. a TaskEnv's task)
        return getattr(self.__dict__["env"], name)

    def reset(self, seeds: Sequence[int]) -> list[str]:
        return self.env.reset(seeds)

    def step(self, actions_text: Sequence[str], indices: Sequence[int] | None = None) -> Any:
        """One (batched) env step of the active episodes, or of `indices` (the text-env protocol), after the
        latency."""
        time.sleep(self.latency_s)
        return self.env.step(actions_text) if indices is None else self.env.step(actions_text, indices=indices)

    def active_indices(self) -> list[int]:
        return self.env.active_indices()

    def counters(self) -> dict[str, float]:
        return self.env.counters()


# ----------------------------------------------------------------------------------------- in-process


class ThreadEnv:
    """The env in this process; each call on a helper thread, waited for at most `timeout_s`."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self._env: Any = None
        self.system_prompt = ""
        self.max_turns: int | None = None
        """The built env's turns per episode (1 for single-turn tasks whatever spec.max_turns); None before
        the first call."""
        self.restarts = 0

    def _ensure(self) -> Any:
        if self._env is None:
            self._env = self.spec.build()
            self.system_prompt = self._env.system_prompt
            self.max_turns = int(self._env.max_turns)
        return self._env

    def call(self, method: str, args: tuple, timeout_s: float | None) -> Any:
        env = self._ensure()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["v"] = getattr(env, method)(*args)
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                box["e"] = e

        if timeout_s is None:
            target()
        else:
            t = threading.Thread(target=target, daemon=True, name=f"env-{method}")
            t.start()
            t.join(timeout_s)
            if t.is_alive():
                self.discard()
                raise EnvFault("env_step_timeout", f"{method} took more than {timeout_s:g}s")
        if "e" in box:
            self.discard()
            e = box["e"]
            raise EnvFault("env_error", f"{method}: {type(e).__name__}: {e}")
        return box["v"]

    def discard(self) -> None:
        """Forget the env (a hung or failed one); the next call builds a new one."""
        if self._env is not None:
            self.restarts += 1
        self._env = None

    def close(self) -> None:
        self._env = None


# ------------------------------------------------------------------------------------------ process


def _child_main(spec: EnvSpec, conn: Any) -> None:  # pragma: no cover - runs in the child process
    try:
        env = spec.build()
        conn.send(("ok", (env.system_prompt, int(env.max_turns))))
    except BaseException as e:  # noqa: BLE001
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "close":
            return
        try:
            conn.send(("ok", getattr(env, method)(*args)))
        except BaseException as e:  # noqa: BLE001
            conn.send(("err", f"{type(e).__name__}: {e}"))


class ProcessEnv:
    """The env in a spawned child process, restarted after a hang or a crash."""

    _ctx = mp.get_context("spawn")

    def __init__(self, spec: EnvSpec, start_timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._proc: Any = None
        self._conn: Any = None
        self.system_prompt = ""
        self.max_turns: int | None = None  # the built env's (ThreadEnv.max_turns)
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        if self._proc is not None:
            self.discard()
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_child_main, args=(self.spec, child), daemon=True, name="thinkcraft-env")
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        status, payload = self._recv("start", self.start_timeout_s)
        self.system_prompt, self.max_turns = payload

    def _recv(self, method: str, timeout_s: float | None) -> tuple[str, Any]:
        try:
            if timeout_s is not None and not self._conn.poll(timeout_s):
                self.discard()
                raise EnvFault("env_step_timeout", f"{method} took more than {timeout_s:g}s (env process killed)")
            status, payload = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            self.discard()
            raise EnvFault("env_crashed", f"env process died during {method} (exit code {code}; {type(e).__name__})")
        if status == "err":
            self.discard()
            raise EnvFault("env_error", f"{method}: {payload}")
        return status, payload

    def call(self, method: str, args: tuple, timeout_s: float | None) -> Any:
        if method != "reset" and self._proc is not None and not self._proc.is_alive():
            # died between two calls: its episodes are gone (a reset may start a fresh process instead)
            code = self._proc.exitcode
            self.discard()
            raise EnvFault("env_crashed", f"env process died before {method} (exit code {code})")
        self._ensure()
        try:
            self._conn.send((method, args))
        except (OSError, BrokenPipeError) as e:
            self.discard()
            raise EnvFault("env_crashed", f"env process gone before {method} ({type(e).__name__})")
        return self._recv(method, timeout_s)[1]

    def discard(self) -> None:
        """Kill the child (if alive) and forget it; the next call starts a new one."""
        if self._proc is None:
            return
        self.restarts += 1
        try:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5.0)
        finally:
            try:
                self._conn.close()
            except OSError:
                pass
            self._proc, self._conn = None, None

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("close", ()))
            self._proc.join(2.0)
        except (OSError, BrokenPipeError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2.0)
        self._proc, self._conn = None, None


def make_env_handle(spec: EnvSpec, mode: Literal["thread", "process"]) -> ThreadEnv | ProcessEnv:
    return ProcessEnv(spec) if mode == "process" else ThreadEnv(spec)
