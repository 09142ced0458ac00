"""`thinkcraft train llm-policy --mode async`: rollouts, rewards and training at the same time (thinkcraft.pools).

The coordinator (this thread) repeats, without ever waiting on one pool while another could work:

    1. admit    new groups (or groups to play again) while AReaL's rule allows:
                (max_staleness + version + 1) x B > accepted + running   (B = prompts_per_step x G)
    2. collect  finished groups: rule-scored ones go to the buffer, judge-deferred ones to the reward pool;
                a failed group is counted (`rollout/failed/<reason>`) and played again under its id
                (after `max_group_attempts` it is abandoned, counted, and a new group takes its place);
                with --dynamic-sampling a group whose rewards all agree is dropped (counted) and replaced
    3. train    when the learner is idle and P groups wait: the P lowest group ids, minus any generated more
                than η versions ago (discarded, played again), go to the learner as one batch; its update
                publishes version v+1 to the engines (shared: at once; copies/HTTP: before their next batch)
    4. log      per update: rewards, staleness histogram, queue depths, busy share per pool, engine and
                device idle share, failures; the trajectory store and `consumed.jsonl` (the trained ids);
                checkpoint every --checkpoint-every updates

η = 0 admits exactly one batch per version and the engine batches on all waiting episodes: the same
prompts, batches, samples and updates as the synchronous loop (tests/test_async_loop.py).

Stop and resume (the training shell, train/session.py). Ctrl-C (or SIGTERM) stops admitting, lets the
update in flight finish, abandons the rollouts in flight and checkpoints; a second one aborts at once (the
previous checkpoint stays valid).
The checkpoint records the learner's state, the ids of the groups trained (consumed), dropped (no signal)
and abandoned, the next new id, and the queue policy. Rollouts in flight or buffered at a stop or a kill are
not in the checkpoint: on resume they are played again from their recorded seeds under the same ids, with
the resumed weights. So a resumed run neither loses a group nor trains one twice, whatever the moment of the
kill (`consumed.jsonl` is truncated to the checkpoint, like metrics.jsonl and the store).
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, fields
from typing import Any

from thinkcraft.pools import staleness as S
from thinkcraft.pools.buffer import ReadyBuffer, group_has_signal
from thinkcraft.pools.contract import Failure, GroupRequest, GroupResult, PoolStopped
from thinkcraft.utils.errors import ConfigError, UserError, check
from thinkcraft.utils.watchdog import StallWatchdog

ASYNC_ONLY = ("max_staleness", "rollout_workers", "env_workers", "env_step_timeout_s", "env_episode_timeout_s",
              "max_group_attempts", "dynamic_sampling", "weight_sync", "rollout_devices", "rollout_servers",
              "gen_batch_wait_ms", "gen_batching", "judge_batch_groups", "rollout_timeout_s", "rollout_api_key_env",
              "rollout_api_key_file", "stall_dump_s")

QUEUE_POLICY = {
    "admission": "AReaL: (max_staleness + version + 1) * batch > accepted + running",
    "batch": "the lowest group ids waiting; groups older than max_staleness versions are played again",
    "in_flight_at_stop": "discarded; played again from their recorded seeds under the same group ids",
}


def check_async_config(cfg: Any) -> None:
    """Validate the async fields (called from LLMPolicyConfig.__post_init__)."""
    if cfg.mode == "sync":
        defaults = {f.name: f.default for f in fields(cfg)}
        for name in ASYNC_ONLY:
            if getattr(cfg, name) != defaults[name]:
                raise ConfigError(name, "applies to the asynchronous loop only: add --mode async")
        return
    check(cfg.action_format == "free" or not cfg.rollout_servers, "action_format",
          "json answers need engines that constrain decoding (in-process hf engines, or Ray engine actors): "
          "drop --rollout-servers")
    check(cfg.max_staleness >= 0, "max_staleness", "must be >= 0 (0 = the synchronous schedule)")
    check(cfg.rollout_workers >= 1, "rollout_workers", "must be >= 1")
    check(cfg.env_step_timeout_s > 0, "env_step_timeout_s", "must be > 0")
    check(cfg.env_episode_timeout_s >= 0, "env_episode_timeout_s", "must be >= 0 (0 = no limit)")
    check(cfg.env_latency_ms >= 0, "env_latency_ms", "must be >= 0")
    check(cfg.max_group_attempts >= 1, "max_group_attempts", "must be >= 1")
    check(cfg.gen_batch_wait_ms >= 0, "gen_batch_wait_ms", "must be >= 0")
    check(cfg.rollout_timeout_s > 0, "rollout_timeout_s", "must be > 0")
    check(cfg.judge_batch_groups >= 1, "judge_batch_groups", "must be >= 1")
    if cfg.dynamic_sampling:
        check(cfg.samples_per_prompt >= 2, "dynamic_sampling", "compares the samples of a group: needs G >= 2")
    for d in (x.strip() for x in cfg.rollout_devices.split(",") if x.strip()):
        check(d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()), "rollout_devices",
              f"{d!r} is not a device (cpu, cuda, cuda:N)")
    if cfg.rollout_api_key_env or cfg.rollout_api_key_file:
        check(bool(cfg.rollout_servers.strip()), "rollout_api_key_env" if cfg.rollout_api_key_env
              else "rollout_api_key_file", "is the key of --rollout-servers (none given)")
        cfg.rollout_api_key()  # an unset variable or unreadable file: one line now
    for spec in (x.strip() for x in cfg.rollout_servers.split(",") if x.strip()):
        check(spec.startswith(("thinkcraft+http", "sglang+http", "vllm+http")), "rollout_servers",
              f"{spec!r}: use thinkcraft+http://host:port, sglang+http://host:port or vllm+http://host:port/v1")


# ---------------------------------------------------------------------------------------- coordinator


@dataclass
class ResumeState:
    """What the checkpoint keeps of the coordinator (group ids; see the module docstring)."""

    next_group: int = 0
    consumed: list[int] | None = None
    dropped: list[int] | None = None
    abandoned: list[int] | None = None

    @classmethod
    def from_checkpoint(cls, extra: dict[str, Any], version: int, prompts_per_step: int) -> "ResumeState":
        a = extra.get("async")
        if a is None:  # a synchronous run's checkpoint: steps 0..v-1 consumed groups 0..v*P-1
            return cls(version * prompts_per_step, list(range(version * prompts_per_step)), [], [])
        return cls(int(a["next_group"]), list(a["consumed"]), list(a["dropped"]), list(a["abandoned"]))


class Coordinator:
    """Admission, collection, batching and the bookkeeping of group ids (steps 1-3 of the docstring)."""

    def __init__(self, cfg: Any, version: int, resume: ResumeState, seed_of: Any, rollout: Any, reward: Any,
                 train_pool: Any) -> None:
        self.cfg, self.seed_of, self.rollout, self.reward, self.train_pool = cfg, seed_of, rollout, reward, train_pool
        self.P, self.G = cfg.prompts_per_step, cfg.samples_per_prompt
        self.version = version
        self.st = S.resumed(S.StalenessState(cfg.max_staleness, self.P * self.G), version)
        self.next_group = resume.next_group
        self.consumed = set(resume.consumed or [])
        self.dropped = set(resume.dropped or [])
        self.abandoned = set(resume.abandoned or [])
        done = self.consumed | self.dropped | self.abandoned
        self.redo = collections.deque(GroupRequest(g, seed_of(g), self.G, 1) for g in range(self.next_group)
                                      if g not in done)
        self.attempts: dict[int, int] = {}
        self.buffer = ReadyBuffer()
        self.training: Any = None
        self.counts: collections.Counter[str] = collections.Counter()
        self.engine_failures_in_a_row = 0
        # each group's schedule (seconds since the coordinator started): admitted, at which learner version,
        # finished; and when its batch went to the learner - what says whether a slow update waited for the
        # engine, for admission or for the learner (`batch_timeline`)
        self._t0 = time.perf_counter()
        self.admitted: dict[int, tuple[float, int]] = {}
        self.finished: dict[int, float] = {}
        self.batch_sent_s: float | None = None

    # 1. admit
    def admit(self) -> None:
        while S.can_admit(self.st, self.version, self.G):
            req = self.redo[0] if self.redo else GroupRequest(self.next_group, self.seed_of(self.next_group), self.G)
            if not self.rollout.submit(req, timeout_s=0.0):
                return  # the rollout queue is full: backpressure
            if self.redo:
                self.redo.popleft()
            else:
                self.next_group += 1
            self.st = S.on_start(self.st, self.G)
            self.admitted[req.group_id] = (self._now(), self.version)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # 2. collect
    def collect(self, timeout_s: float) -> None:
        results = self.rollout.poll(256, timeout_s)
        if self.reward is not None:
            results += self.reward.poll(256, 0.0)
        for r in results:
            if isinstance(r, Failure):
                self._failed(r)
            elif not r.scored:
                try:
                    self.reward.submit(r)
                except PoolStopped:  # the run is stopping (`_loop`'s last collect): played again on resume
                    self._failed(Failure(r, "stopped", "the reward pool stopped before it scored the group"))
            else:
                self._scored(r)

    def _failed(self, f: Failure) -> None:
        req = f.request if isinstance(f.request, GroupRequest) else f.request.request
        self.st = S.on_reject(self.st, self.G)
        self.counts[f"rollout/failed/{f.reason}"] += 1
        if f.reason == "stopped":
            return  # the run is stopping: played again on resume
        self.engine_failures_in_a_row = self.engine_failures_in_a_row + 1 if f.reason == "engine_error" else 0
        if self.engine_failures_in_a_row > max(8, 2 * self.cfg.rollout_workers):
            raise UserError(f"the rollout engine failed {self.engine_failures_in_a_row} groups in a row (last: "
                            f"{f.detail}); stopping. The last checkpoint is intact: fix the engine, then --resume")
        self._again(req)

    def _again(self, req: GroupRequest) -> None:
        n = self.attempts.get(req.group_id, req.attempt) + 1
        self.attempts[req.group_id] = n
        if n >= self.cfg.max_group_attempts:
            self.abandoned.add(req.group_id)
            self.admitted.pop(req.group_id, None)
            self.counts["rollout/abandoned"] += 1
            return
        self.redo.append(GroupRequest(req.group_id, req.seed, req.num_samples, n))

    def _scored(self, g: GroupResult) -> None:
        self.engine_failures_in_a_row = 0
        if self.cfg.dynamic_sampling and not group_has_signal([t.total_reward for t in g.trajectories]):
            self.st = S.on_reject(self.st, self.G)
            self.dropped.add(g.request.group_id)
            self.admitted.pop(g.request.group_id, None)  # never trained: no schedule kept
            self.counts["dynamic/dropped_groups"] += 1
            return
        self.st = S.on_accept(self.st, self.G)
        self.buffer.add(g)
        self.finished[g.request.group_id] = self._now()

    # 3. train
    def maybe_train(self) -> None:
        if self.training is not None:
            return
        # the per-trajectory guard: nothing generated more than η versions ago trains; played again instead
        stale = self.buffer.remove_where(
            lambda g: any(S.too_stale(self.st, self.version, t.oldest_version) for t in g.trajectories))
        for g in stale:
            self.st = S.on_discard(self.st, self.G)
            self.counts["rollout/too_stale"] += 1
            self._again(g.request)
        batch = self.buffer.take(self.P)
        if batch is None:
            return
        from thinkcraft.train.llm_policy.async_build import TrainBatch

        self.training = TrainBatch(self.version, batch)
        self.batch_sent_s = self._now()
        self.train_pool.submit(self.training)

    def trained(self, res: Any) -> dict[str, Any]:
        """Book the update; returns the batch's timeline (`batch_timeline`)."""
        self.version = res.version
        self.consumed.update(res.groups)
        self.training = None
        return self.batch_timeline(res.groups)

    def batch_timeline(self, groups: list[int]) -> dict[str, Any]:
        """The trained groups' schedule: per group [admitted s, learner version then, finished s] (seconds since
        the coordinator started; for consumed.jsonl), and the means the metrics keep: admission to finish
        (`rollout/group_latency_s`, its max), finish to the batch's hand-over to the learner
        (`rollout/group_wait_s`: a group that waited for the rest of its batch, or for the learner)."""
        raw = []
        for g in groups:
            a, v = self.admitted.pop(g, (float("nan"), -1))
            raw.append((a, v, self.finished.pop(g, float("nan"))))
        # the means from the clock's readings, the timeline rounded to ms: from rounded times a group that finished
        # 0.4 ms before the hand-over could wait -0.1 ms (its finish rounded up past the hand-over; CI, 2026-11-29)
        rows = [[round(a, 3), v, round(f, 3)] for a, v, f in raw]
        lat = [f - a for a, _, f in raw if f == f and a == a]
        sent = self.batch_sent_s if self.batch_sent_s is not None else float("nan")
        wait = [sent - f for _, _, f in raw if f == f]
        return {"times": rows, "batch_sent_s": round(sent, 3),
                "rollout/group_latency_s": sum(lat) / len(lat) if lat else 0.0,
                "rollout/group_latency_max_s": max(lat, default=0.0),
                "rollout/group_wait_s": sum(wait) / len(wait) if wait else 0.0}

    def state(self) -> dict[str, Any]:
        return {"next_group": self.next_group, "consumed": sorted(self.consumed), "dropped": sorted(self.dropped),
                "abandoned": sorted(self.abandoned), "queue_policy": QUEUE_POLICY}


# ------------------------------------------------------------------------------------------------ run


def group_seed_fn(cfg: Any, v_star: dict[int, float] | None) -> Any:
    """group id -> problem seed: group g is prompt g % P of step g // P, as in the synchronous loop."""
    from thinkcraft.train.llm_policy.rollout import _seed_of

    P = cfg.prompts_per_step
    if cfg.algo != "apo":
        return lambda g: _seed_of(cfg, g // P + 1, g % P)
    pool = sorted(v_star or {})

    def apo_seed(g: int) -> int:
        rng = random.Random(cfg.seed * 1_000_003 + g // P)  # the sync loop's draw for that step
        return [pool[rng.randrange(len(pool))] for _ in range(P)][g % P]

    return apo_seed


def run_async(cfg: Any) -> dict[str, Any]:
    """The asynchronous loop (module docstring) inside the training shell: build, resume, then steps 1-4 until
    `cfg.steps` updates or a stop; the pools are stopped and a checkpoint written on the way out."""
    from thinkcraft.train.checkpoint import TORCH_CODEC
    from thinkcraft.train.llm_policy.async_run import PLOT_KEYS, AsyncRun
    from thinkcraft.train.llm_policy.config import SHAPE_FIELDS, LLMPolicyConfig
    from thinkcraft.train.session import TrainSession
    from thinkcraft.utils.progress import console

    session = TrainSession(cfg, "llm-policy", shape_fields=SHAPE_FIELDS, defaults=LLMPolicyConfig(),
                           total_steps=lambda c: c.steps,
                           title=lambda c: f"llm-policy {c.algo} on {c.env} (async, η={c.max_staleness})",
                           plot_keys=PLOT_KEYS, codec=TORCH_CODEC, x_label="learner steps", update_word="step")
    cfg = session.cfg
    with session:
        run = AsyncRun(cfg, session)
        try:
            run.build()
            session.start(run.coord.version)
            with StallWatchdog(cfg.stall_dump_s, session.run_dir / "stalls.txt", "learner step") as watchdog:
                _loop(run, session, watchdog)
        finally:
            run.close()
        s, c = session.summary, run.coord
        failed = sum(v for k, v in c.counts.items() if k.startswith("rollout/failed/") and not k.endswith("/stopped"))
        console.print(f"done: {c.version:,}/{cfg.steps:,} steps; reward {s.get('reward/mean', float('nan')):.3f}; "
                      f"samples/s {s.get('perf/samples_per_s', 0):.2f}; staleness {s.get('staleness/mean', 0):.2f}; "
                      f"{run.idle_label} idle {100 * s.get('gpu/idle_share', 0):.0f}%; "
                      f"groups failed {failed} (played again), abandoned {len(c.abandoned)}, in flight at the end "
                      f"{c.counts['rollout/failed/stopped']}; run dir {session.run_dir}", soft_wrap=True)
    return session.summary


def _loop(run: Any, session: Any, watchdog: Any = None) -> None:
    cfg, coord = run.cfg, run.coord
    while session.running(coord.version, cfg.steps):
        if run.front.fatal:
            raise UserError(f"{run.front.fatal}; the last checkpoint is intact: fix the engine, then --resume")
        coord.admit()
        coord.collect(0.01)
        coord.maybe_train()
        for res in run.train_pool.poll(4, 0.0):
            run.on_trained(res)
            if watchdog is not None:
                watchdog.beat()
    while coord.training is not None:  # a stop: the update in flight finishes first (its groups are consumed)
        for res in run.train_pool.poll(4, 1.0):
            run.on_trained(res)
    run.stop_pools()
    coord.collect(0.0)  # count what the stop abandoned (played again on resume)
    run.checkpoint(force=True)
