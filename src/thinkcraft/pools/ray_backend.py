"""The Ray backend of the llm-policy pools (`train llm-policy --mode async --pool-backend ray`, issue 21).

The same pool contract as the local backend (pools.contract: submit / poll / health / stop), the same
coordinator, engine front and learner; what moves into Ray actors is the work that needs its own device
or process:

    driver (this process)                      Ray actors, in one placement group
    ---------------------                      ----------------------------------------------------------
    Coordinator, learner (--device)            EngineActor x --ray-engines  (bundle {CPU, GPU: --ray-engine-gpus})
    EngineFront: batching over all episodes      an HFEngine on its own copy of the policy, CopyWeights
      slot k -> RayEngine(actor k)  ------------>   generate(Batch) ; load_state / nccl_load (ray_weights.py)
    RayRolloutPool: one thread per worker        EnvActor x --rollout-workers  (bundle {CPU: --ray-env-cpus})
      episode loop -> RayEnvHandle(actor w) --->    the text env: reset / step / active_indices
    RewardPool (judge rewards)                   JudgeActor (bundle {CPU, GPU: --ray-judge-gpus}): the judge
      judge -> RayJudge(actor) ---------------->    engine of --judge-engine (not "self": that is the policy)

Batching stays in the driver's EngineFront, so for a deterministic schedule (η = 0) the engine actor sees
exactly the local backend's batches (same prompts, same order) and, seeded like the driver, draws the same
samples: the Ray backend reproduces the local one (tests/test_pools_ray.py).

Faults, with the local backend's semantics: an actor that dies (or hangs past its timeout: it is killed)
is replaced by a fresh one in the same bundle and counted in `health().restarts`; the work it had in flight
fails (env_crashed / env_step_timeout, engine_error, reward_error) and the coordinator plays that group
again under its id, so nothing is lost or trained twice. A replaced engine starts from the initial weights
and takes the newest published version before its next batch (its WeightSync is reset).

Cluster: `--ray-address` joins an existing cluster (thinkcraft must be importable on its nodes); without
it a local Ray is started (and stopped at the end). The placement group is reserved before anything
runs; if it is not ready within `--ray-start-timeout-s` the run stops with the resources it requested
and what the cluster has available.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from thinkcraft.llm.protocol import Capabilities, GenerationRequest, GenerationResult
from thinkcraft.pools.envproc import EnvFault, EnvSpec
from thinkcraft.pools.rollout import RolloutPool
from thinkcraft.utils.errors import UserError

log = logging.getLogger(__name__)

RAY_MISSING = "{what} needs Ray, which is not installed: pip install thinkcraft[ray]"


def require_ray(what: str = "--pool-backend ray") -> Any:
    """The ray module, or a one-line UserError saying that `what` (the option asking for it) needs Ray."""
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING.format(what=what)) from None
    return ray


def actor_failure(e: BaseException) -> str:
    """One line for an actor that failed to start: its constructor's exception is the last line of Ray's report."""
    import ray

    cause = getattr(e, "cause", None) or e
    last = (str(cause).strip().splitlines() or [""])[-1]
    return last if isinstance(cause, ray.exceptions.RayError) else f"{type(cause).__name__}: {last}"


# ------------------------------------------------------------------------------------------ resources


@dataclass(frozen=True)
class RayLayout:
    """What the placement group reserves (from the config: `ray_layout`)."""

    engines: int
    engine_cpus: float
    engine_gpus: float
    env_workers: int
    env_cpus: float
    judge: bool
    """A judge actor (--reward judge with an engine of its own; not for rule rewards or --judge-engine self)."""
    judge_gpus: float = 0.0

    def bundles(self) -> list[dict[str, float]]:
        """Engines first (bundle k = engine k), then one per env worker, then the judge."""
        engine = {"CPU": self.engine_cpus, **({"GPU": self.engine_gpus} if self.engine_gpus > 0 else {})}
        out = [dict(engine) for _ in range(self.engines)] + [{"CPU": self.env_cpus} for _ in range(self.env_workers)]
        if self.judge:
            out.append({"CPU": 1.0, **({"GPU": self.judge_gpus} if self.judge_gpus > 0 else {})})
        return out

    def env_bundle(self, worker: int) -> int:
        return self.engines + worker

    @property
    def judge_bundle(self) -> int:
        return self.engines + self.env_workers


def ray_layout(cfg: Any, cuda: bool) -> RayLayout:
    """The config's layout; GPU counts left unset are 1 where the machine has CUDA (`cuda`), else 0."""
    def gpus(value: float | None) -> float:
        return (1.0 if cuda else 0.0) if value is None else float(value)

    return RayLayout(cfg.ray_engines, cfg.ray_engine_cpus, gpus(cfg.ray_engine_gpus), cfg.rollout_workers,
                     cfg.ray_env_cpus, cfg.reward == "judge" and cfg.judge_engine != "self", gpus(cfg.ray_judge_gpus))


def summed(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def placement_timeout_message(bundles: list[dict[str, float]], total: dict[str, float],
                              available: dict[str, float], timeout_s: float) -> str:
    """The one line a run stops with when its placement group is not ready in time."""
    def fmt(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items()) if k in ("CPU", "GPU") or k in want) or "nothing"

    want = summed(bundles)
    short = {k: v for k, v in want.items() if available.get(k, 0.0) < v}
    return (f"Ray could not reserve the pools' resources within {timeout_s:g}s: requested {fmt(want)} in "
            f"{len(bundles)} bundles (largest {fmt(max(bundles, key=lambda b: sum(b.values())))}); the cluster has "
            f"{fmt(total)}, available now {fmt(available)}"
            + (f"; short of {', '.join(sorted(short))}" if short else "; no single node fits a bundle")
            + ". Lower --ray-engines / --ray-engine-gpus / --ray-env-cpus / --rollout-workers, add nodes, or raise "
              "--ray-start-timeout-s")


def connect(address: str, hide_device: Any = None, env_vars: dict[str, str] | None = None, **init_kw: Any) -> bool:
    """Join `address` (an existing cluster) or start a local Ray (`init_kw`: more ray.init arguments, e.g.
    num_cpus); True when this call started it. A local Ray does not see `hide_device` (the learner's GPU):
    its actors get the other GPUs."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return False
    # local workers import thinkcraft from where the driver did (a source checkout on PYTHONPATH included)
    import thinkcraft

    src = os.path.dirname(os.path.dirname(os.path.abspath(thinkcraft.__file__)))
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    hidden = _without_gpu(hide_device)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if hidden is not None:  # read by the raylet it starts (the driver's CUDA is already initialised)
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        runtime_env = dict(init_kw.pop("runtime_env", {}))
        runtime_env["env_vars"] = {"PYTHONPATH": path, **(env_vars or {})}
        ray.init(include_dashboard=False, runtime_env=runtime_env, **init_kw)
    finally:
        if hidden is not None:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return True


def _without_gpu(device: Any) -> str | None:
    """CUDA_VISIBLE_DEVICES for a local Ray that must not hand out `device` (None: a CPU learner, or the
    machine's only GPU, which the engines then share with the learner)."""
    import torch

    if device is None or torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return ",".join(d for i, d in enumerate(ids) if i != index)


def reserve(bundles: list[dict[str, float]], timeout_s: float) -> Any:
    """A ready placement group for `bundles`, or a UserError naming what it waited for."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        total, available = ray.cluster_resources(), ray.available_resources()
        remove_placement_group(pg)
        raise UserError(placement_timeout_message(bundles, total, available, timeout_s)) from None
    return pg


# ----------------------------------------------------------------------------------------------- actors


class _EnvActor:
    """One rollout worker's text env."""

    def __init__(self, spec: EnvSpec) -> None:
        self.env = spec.build()

    def describe(self) -> tuple[str, int]:
        """(system prompt, the built env's turns per episode)."""
        return self.env.system_prompt, int(self.env.max_turns)

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.env, method)(*args)


class _EngineActor:
    """An in-process engine on its own copy of the policy (on the bundle's GPU, else the CPU).

    `make_engine(model) -> engine` builds it (the trainer's own builder, so the actor's engine is the one the
    local backend would use); `setup()` runs last, as the driver seeds its sampling stream after building."""

    def __init__(self, model: Any, make_engine: Callable[[Any], Any], setup: Callable[[], None], version: int,
                 threads: int, bf16: bool) -> None:
        import torch

        from thinkcraft.pools.weights import CopyWeights

        from thinkcraft.llm.hf.cache import log_cache_events

        torch.set_num_threads(max(1, threads))
        log_cache_events()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.engine = make_engine(self.model)
        self.sync = CopyWeights(self.model, version, on_change=self.engine.invalidate_prefix_cache)
        self.autocast = self.device.type == "cuda" and bf16
        self.group: Any = None
        self.lock = threading.Lock()
        """Held by generate and by every weight change (the actor serves calls on several threads)."""
        self.continuous = False
        """Stepping on the engine's own thread (`start_continuous`): requests come by `submit_many`, results go by
        `poll_wait`, weights are taken between two decode steps."""
        setup()

    def ready(self) -> int:
        return self.sync.version

    def start_continuous(self) -> int:
        """Run the engine's decode loop on its own thread in this process (continuous batching), under bf16
        autocast where generate would; from now on a weight update goes through the engine's versioned
        `update_weights` (applied between two decode steps; running rows go on under the new version). Returns
        the version held. Idempotent."""
        from thinkcraft.pools.weights import CopyWeights

        with self.lock:
            if not self.continuous:
                self.sync = CopyWeights(self.model, self.sync.version, engine=self.engine)  # labels the version
                self.engine.start(self._gen_context)  # entered on the engine's thread (autocast is per thread)
                self.continuous = True
        return self.sync.version

    def submit_many(self, requests: list[Any]) -> list[tuple[int | None, str | None]]:
        """Queue requests on the running engine (`start_continuous`): per request, in order, (its engine handle,
        None), or (None, why) where the engine refused it (e.g. longer than a slot) - the others still run."""
        out: list[tuple[int | None, str | None]] = []
        for r in requests:
            try:
                out.append((self.engine.submit(r), None))
            except Exception as e:  # noqa: BLE001 - that request's group fails, not the batch
                out.append((None, f"{type(e).__name__}: {e}"))
        return out

    def poll_wait(self, timeout_s: float) -> list[Any]:
        """The results finished since the last call, waiting up to `timeout_s` for the first (short sleeps: the
        engine's thread keeps the interpreter lock for its steps)."""
        end = time.perf_counter() + timeout_s
        while True:
            out = self.engine.poll()
            if out or time.perf_counter() >= end:
                return out
            time.sleep(POLL_SLEEP_S)

    def release(self, episode: Any) -> None:
        self.engine.release(episode)

    def _gen_context(self) -> Any:
        """The context a generation runs in: bf16 autocast on a GPU actor serving bf16, else nothing."""
        import contextlib

        import torch

        from thinkcraft.llm import compat

        return compat.autocast(torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def generate(self, batch: Any, sampling: Any) -> Any:
        with self.lock, self._gen_context():
            return self.engine.generate(batch, sampling)

    def reserve(self, rows: int, tokens: int, prefix_tokens: int = 0) -> None:
        """Size the engine's KV cache before its first batch (engines without a cache: nothing to do)."""
        fn = getattr(self.engine, "reserve", None)
        if fn is not None:
            fn(rows, tokens, prefix_tokens)

    def decode_metrics(self) -> dict[str, float]:
        """The engine's cumulative decode counters (a snapshot, read beside a running generate: the actor serves
        calls on several threads), for the driver's per-update engine metrics."""
        return dict(self.engine.decode_metrics())

    def load_state(self, version: int, state: dict[str, Any], kind: str) -> tuple[int, str]:
        from thinkcraft.pools.ray_weights import state_checksum
        from thinkcraft.pools.weights import WeightUpdate

        got = state_checksum(state)
        with self.lock:
            self.sync.apply(WeightUpdate(version, state, kind))  # type: ignore[arg-type]
        return self.sync.version, got

    def checksum(self, names: list[str]) -> tuple[int, str]:
        """(version held, checksum of the named parameters as the engine holds them)."""
        from thinkcraft.pools.ray_weights import state_checksum

        return self.sync.version, state_checksum(dict(self.model.named_parameters()), names)

    def nccl_join(self, host: str, port: int, rank: int, world: int, backend: str = "nccl") -> None:
        from thinkcraft.pools.ray_weights import nccl_group

        self.group = nccl_group(host, port, rank, world, backend=backend)

    def nccl_load(self, version: int, metas: list[Any], bucket_bytes: int, kind: str) -> tuple[int, str]:
        from thinkcraft.pools.ray_weights import nccl_receive
        from thinkcraft.pools.weights import WeightUpdate

        # into fresh buffers (a batch may be running); the digest is of what arrived, before any cast
        got, checksum = nccl_receive(self.group, metas, bucket_bytes, self.device)
        with self.lock:
            self.sync.apply(WeightUpdate(version, got, kind))  # type: ignore[arg-type]
        return self.sync.version, checksum


class _JudgeActor:
    """The judge of --reward judge (its own engine, e.g. a model on its own GPU): `build() -> RewardFn`."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.reward_fn = build()

    def ready(self) -> bool:
        return True

    def judge(self, problems: list[Any], completions: list[str]) -> Any:
        return self.reward_fn(problems, completions)


class ActorHandle:
    """A replaceable actor: `factory(k)` makes the k-th incarnation. A call that finds the actor dead, or
    gets no answer within its timeout (the actor is then killed), replaces it and raises `ActorLost`."""

    def __init__(self, name: str, factory: Callable[[int], Any]) -> None:
        self.name = name
        self.factory = factory
        self.restarts = 0
        self._lock = threading.Lock()
        self.actor = factory(0)
        self.on_replace: list[Callable[[], None]] = []
        self.closed = False
        """Killed on purpose (`kill`): a call that then finds it dead is not a fault, and nothing replaces it."""

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        import ray

        actor = self.actor
        try:
            return ray.get(getattr(actor, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.replace(actor)
            raise ActorLost(self.name, "timeout", f"{method} took more than {timeout_s:g}s (actor killed)") from None
        except ray.exceptions.RayActorError as e:
            self.replace(actor)
            raise ActorLost(self.name, "died", f"{method}: actor died ({type(e).__name__})") from None

    def replace(self, dead: Any) -> None:
        """A fresh actor in place of `dead` (once, however many callers saw it die)."""
        import ray

        with self._lock:
            if self.actor is not dead or self.closed:  # (a pool stopping kills its actors under running calls:
                return  # those calls fail, and a replacement then would be an actor started at shutdown, leaked)
            ray.kill(dead, no_restart=True)
            self.restarts += 1
            log.warning("ray: %s replaced (restart %d)", self.name, self.restarts)
            self.actor = self.factory(self.restarts)
        for f in self.on_replace:
            f()

    def kill(self) -> None:
        import ray

        with self._lock:
            self.closed = True
        ray.kill(self.actor, no_restart=True)


def wait_ready(actors: list[ActorHandle], method: str, timeout_s: float) -> list[Any]:
    """`method()` of every actor, called at once: their first answers (each constructor has run), or a
    UserError naming the actor that did not start and why."""
    import ray

    refs = [getattr(a.actor, method).remote() for a in actors]
    out = []
    for a, ref in zip(actors, refs):
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise UserError(f"Ray actor {a.name} did not start within {timeout_s:g}s") from None
        except ray.exceptions.RayError as e:
            raise UserError(f"Ray actor {a.name} failed to start: {actor_failure(e)}") from None
    return out


class ActorLost(RuntimeError):
    def __init__(self, name: str, how: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.how = how


class RayEnvHandle:
    """A rollout worker's env in an actor, with the interface of pools.envproc's ThreadEnv / ProcessEnv."""

    def __init__(self, actor: ActorHandle, system_prompt: str, max_turns: int | None = None) -> None:
        self.actor = actor
        self.system_prompt = system_prompt
        self.max_turns = max_turns

    @property
    def restarts(self) -> int:
        return self.actor.restarts

    def call(self, method: str, args: tuple, timeout_s: float | None) -> Any:
        import ray

        try:
            return self.actor.call("call", method, args, timeout_s=timeout_s)
        except ActorLost as e:
            raise EnvFault("env_step_timeout" if e.how == "timeout" else "env_crashed", str(e)) from None
        except ray.exceptions.RayTaskError as e:  # the env raised: its state is suspect, a fresh one next group
            self.actor.replace(self.actor.actor)
            raise EnvFault("env_error", f"{method}: {e.cause!r}") from None

    def close(self) -> None:
        self.actor.kill()


POLL_SLEEP_S = 0.002
"""How often an engine actor looks for finished results while the driver waits (`poll_wait`): a group's
results reach the driver at most this late, against ~1.8 s of generation for the arith bench's groups."""
POLL_WAIT_S = 0.01
"""The longest a driver's `step` waits in one call for results: it then sends the requests queued meanwhile and
takes due weight updates, so a group admitted after a publication waits at most this long to reach the actor
(in-process, about one decode step). ~100 calls a second while requests run, each waiting in `ray.get` without
the interpreter lock."""


class RayEngine:
    """The `engine` of an EngineSlot whose engine is an actor.

    Whole calls (`continuous=False`): `generate` only, batching is the front's. Continuous (`continuous=True`,
    `--gen-batching auto` or `continuous`): the actor's engine steps on its own thread (`start_continuous`), so
    the driver process - the learner's - never runs a decode step (in-process engines share the learner's
    interpreter lock: 2 x H200, 2026-11-30, the learner's update took 0.65-0.94 s beside a copy engine on the
    other GPU against 0.47-0.51 s alone). `submit` queues requests here and hands out this side's handles;
    `step` sends them in one call and waits (`POLL_WAIT_S` at most) for finished results, which `poll` returns.
    An actor that dies or stops answering fails every request it held (error results: the front fails their
    groups, which the rollout pool plays again) and is replaced by the `ActorHandle`."""

    reserves_whole_batches = True
    """The front sizes this engine's cache up front although it batches whole `generate` calls: without it the
    actor's cache grew with the batches it met, and each new size compiled and captured a decode graph again
    (~40 s on an H200) in the middle of a run (4 x H200, 2026-11-28: captures at steps 3-7 of 6-8-step runs)."""

    def __init__(self, actor: ActorHandle, timeout_s: float | None, continuous: bool = False) -> None:
        self.actor_handle = actor
        self.timeout_s = timeout_s
        self.continuous = continuous
        self._reservation: tuple[int, int, int] | None = None
        self._reserved_actor: Any = None  # the incarnation that has it: a replacement gets it before its first batch
        self._counters_before: dict[str, float] = {}  # the last summed decode counters (decode_metrics)
        self._base: dict[str, float] = {}
        self._restarts_seen = 0
        # continuous: the incarnation whose engine thread runs; requests not sent yet; this side's handle of each
        # request the actor holds (by the actor's handle); finished results for `poll`
        self._started_actor: Any = None
        self._next_handle = 0
        self._outbox: list[tuple[int, GenerationRequest]] = []
        self._held: dict[int, tuple[int, GenerationRequest]] = {}
        self._done: list[GenerationResult] = []

    @property
    def capabilities(self) -> Capabilities:
        """Continuous batching where this engine runs continuously (the front's `supports_continuous`); the rest
        is the front's business (token ids in and out, log-probs, the shared prefix: the actor's hf engine)."""
        return Capabilities(hidden_states=False, generate=True, logprobs=True, prefix_reuse=True,
                            token_ids_in=True, token_ids_out=True, continuous_batching=self.continuous,
                            turn_kv_reuse=self.continuous)

    @property
    def actor(self) -> Any:
        return self.actor_handle.actor

    @property
    def restarts(self) -> int:
        return self.actor_handle.restarts

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self.actor_handle.call(method, *args, timeout_s=timeout_s)

    def reserve(self, rows: int, tokens: int, prefix_tokens: int = 0) -> None:
        """Size the actor engine's KV cache for `rows` sequences of `tokens` columns (see the class attribute);
        kept and sent again to a replacement actor before its first batch."""
        self._reservation = (int(rows), int(tokens), int(prefix_tokens))
        self._reserve_now()

    def _reserve_now(self) -> None:
        actor = self.actor
        if self._reservation is not None and self._reserved_actor is not actor:
            self.call("reserve", *self._reservation, timeout_s=self.timeout_s)
            self._reserved_actor = actor

    def generate(self, batch: Any, sampling: Any) -> Any:
        self._reserve_now()
        return self.call("generate", batch, sampling, timeout_s=self.timeout_s)

    # --- continuous batching (the front's slot thread: submit / step / poll / release, one thread) ---------------

    def submit(self, request: GenerationRequest) -> int:
        if not self.continuous:
            raise RuntimeError("submit: this Ray engine batches whole calls (continuous=False)")
        h = self._next_handle
        self._next_handle += 1
        self._outbox.append((h, request))
        return h

    def step(self) -> bool:
        """Send the queued requests, then wait (at most `POLL_WAIT_S`) for finished ones. True while some are
        held. A lost actor (dead, or silent past the timeout) fails every request it held."""
        try:
            actor = self._ensure_started()
            if self._outbox:
                sent, self._outbox = self._outbox, []
                self._held.update({-1 - h: (h, r) for h, r in sent})  # until the actor answers: failed if it dies
                answers = self.call("submit_many", [r for _, r in sent], timeout_s=self.timeout_s)
                for h, r in sent:
                    del self._held[-1 - h]
                for (h, r), (ah, why) in zip(sent, answers):
                    if ah is None:
                        self._fail([(h, r)], why)
                    else:
                        self._held[int(ah)] = (h, r)
            if self._held:
                for res in self.call("poll_wait", POLL_WAIT_S, timeout_s=self._poll_timeout()):
                    got = self._held.pop(int(res.handle), None)
                    if got is not None:
                        self._done.append(replace(res, handle=got[0]))
            if self.actor is not actor:  # replaced under us (another call saw it die): what it held is gone
                raise ActorLost(self.actor_handle.name, "died", "replaced while it held requests")
        except ActorLost as e:
            self._fail_held(str(e))
        except Exception as e:  # noqa: BLE001 - the actor raised: what it held is failed, the front says so
            self._fail_held(f"{self.actor_handle.name}: {type(e).__name__}: {e}")
            raise
        return bool(self._held or self._outbox)

    def poll(self) -> list[GenerationResult]:
        out, self._done = self._done, []
        return out

    def release(self, episode: Any) -> None:
        if self.continuous and self._started_actor is self.actor:
            self.actor.release.remote(episode)  # fire and forget: a lost release only keeps KV the engine evicts

    def _ensure_started(self) -> Any:
        """This incarnation's engine thread started and its cache sized (once per incarnation)."""
        actor = self.actor
        if self._started_actor is not actor:
            if self._held:  # a replacement: the requests the dead one held are lost (those not sent yet go to it)
                self._fail_held(f"{self.actor_handle.name}: actor replaced", outbox=False)
            self._reserve_now()
            self.call("start_continuous", timeout_s=self.timeout_s)
            self._started_actor = actor
        return actor

    def _poll_timeout(self) -> float | None:
        return None if self.timeout_s is None else self.timeout_s + POLL_WAIT_S

    def _fail_held(self, why: str, outbox: bool = True) -> None:
        lost = list(self._held.values()) + (list(self._outbox) if outbox else [])
        self._held = {}
        if outbox:
            self._outbox = []
        self._fail(lost, why)

    def _fail(self, requests: list[tuple[int, GenerationRequest]], why: str) -> None:
        self._done += [GenerationResult.failed(h, r, why) for h, r in requests]

    def decode_metrics(self) -> dict[str, float]:
        """The actor engine's decode counters, summed over the actors this slot has had (a replacement starts
        from zero: the ones it replaced are kept, so the driver's deltas never go backwards); what a dead or
        silent actor cannot tell (10 s) is left out of that update's metrics - never a stall or an error. A
        read never replaces the actor: a fresh one still starting (its process, its model) answers late, and
        a dead one is replaced by the next generate, whose caller re-issues the work."""
        import ray

        restarts, actor = self.restarts, self.actor  # read together: a reading belongs to this incarnation
        try:
            got = ray.get(actor.decode_metrics.remote(), timeout=10.0)
        except Exception as e:  # noqa: BLE001 - a metric is not worth failing a step for
            log.info("%s: no decode counters this update (%s)", self.actor_handle.name, type(e).__name__)
            return dict(self._counters_before)
        if restarts != self._restarts_seen:  # a fresh actor: its predecessor's last reading stays in the sum
            self._base = dict(self._counters_before)
            self._restarts_seen = restarts
        total = {k: self._base.get(k, 0.0) + float(v) for k, v in got.items()}
        self._counters_before = total
        return total


class RayJudge:
    """RewardPool's judge, called in the judge actor (a failure fails the groups: played again)."""

    def __init__(self, actor: ActorHandle, timeout_s: float | None) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def __call__(self, problems: list[Any], completions: list[str]) -> Any:
        return self.actor.call("judge", problems, completions, timeout_s=self.timeout_s)


class RayRolloutPool(RolloutPool):
    """RolloutPool whose workers' envs are actors; `health().restarts` counts env and engine replacements."""

    def __init__(self, *args: Any, env_actor: Callable[[int], ActorHandle], engines: list[RayEngine],
                 start_timeout_s: float = 300.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.engines = engines
        actors = [env_actor(w) for w in range(self.num_workers)]  # all started at once, then awaited
        described = wait_ready(actors, "describe", start_timeout_s)
        self._envs = {w: RayEnvHandle(a, p, t) for w, (a, (p, t)) in enumerate(zip(actors, described))}

    def _env_for(self, worker: int) -> Any:
        return self._envs[worker]

    def health(self) -> Any:
        from dataclasses import replace

        h = super().health()
        return replace(h, restarts=h.restarts + sum(e.restarts for e in self.engines))
