"""The asynchronous loop's run: the pieces built in order inside the training shell (train/session.py: run
directory, resume, verified checkpoints, metrics, Ctrl-C/SIGTERM, progress, curve), per-update metrics, the
trajectory store and the consumed-ids journal. The coordinator and the loop are async_loop.py.

Besides the synchronous loop's files, the run directory holds `consumed.jsonl`, one line per update
{"step": version, "groups", "traj_ids", "staleness"}: what each update trained on (truncated to the
checkpoint on resume, like metrics.jsonl and the store), and `weights/` for HTTP engines.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from thinkcraft.pools import FairLock, Failure, SharedWeights
from thinkcraft.train.llm_policy.async_build import (
    TrainResult, TrainWorker, build_front, build_reward_pool, build_rollout_pool, build_slots, device_name,
    weight_update,
)
from thinkcraft.train.llm_policy.async_loop import Coordinator, ResumeState, group_seed_fn
from thinkcraft.utils.errors import UserError
from thinkcraft.utils.timing import PhaseTimer
from thinkcraft.utils.watchdog import GilProbe

log = logging.getLogger(__name__)

PLOT_KEYS = ("reward/mean", "reward/correct_rate", "staleness/mean", "gpu/idle_share", "perf/samples_per_s")


class AsyncRun:
    """Everything the loop uses, built once in `build` (in the synchronous loop's order first: the policy)."""

    def __init__(self, cfg: Any, session: Any) -> None:
        self.cfg, self.session = cfg, session
        self.run_dir = session.run_dir
        self._closers: list[Any] = []

    def build(self) -> "AsyncRun":
        from thinkcraft.train.llm_policy.learner import restore_state
        from thinkcraft.train.llm_policy.loop import Carry, _open_store, apo_offline, build_policy
        from thinkcraft.train.llm_policy.model import resolve_model_path
        from thinkcraft.utils.metrics import truncate_metrics

        cfg, session = self.cfg, self.session
        # 1. the policy as the synchronous loop builds it (env, model, engine over the learner, learner)
        self.policy = p = build_policy(cfg)
        # 2. resume: weights, optimizer, RNG, carry; the group ids' bookkeeping; journals cut to the checkpoint
        version, extra = 0, {}
        if session.resuming:
            version, extra = restore_state(p.learner, session.restore())
            truncate_metrics(self.run_dir / "consumed.jsonl", version)
        session.save_config()
        self.writer = _open_store(cfg, self.run_dir, version)
        if self.writer is not None:
            self._closers.append(self.writer.close)
        self.journal = open(self.run_dir / "consumed.jsonl", "a", encoding="utf-8")
        self._closers.append(self.journal.close)
        carry = Carry(extra.get("baseline"), extra.get("v_star"))
        if cfg.algo == "apo" and carry.v_star is None:  # before the pools: it samples with the engine alone
            carry = carry._replace(v_star=apo_offline(cfg, p, session.timer))
        # 3. engines (shared / copies / HTTP) behind one front; rollout, reward and training pools
        self.model_lock = FairLock()  # the learner is served between two decode steps, never starved
        model_dir = None if cfg.model_spec.scheme == "random" else str(resolve_model_path(cfg.model))
        self.ray = None
        if cfg.pool_backend == "ray":  # engines, envs and judge as Ray actors (train/llm_policy/ray_build.py)
            from thinkcraft.train.llm_policy.ray_build import build_ray_pools

            self.ray = build_ray_pools(cfg, p, version)
            self._closers.append(self.ray.close)
            self.slots, self.rollout = self.ray.slots, self.ray.rollout
        else:
            self.slots = build_slots(cfg, p.learner, p.tokenizer, p.engine, self.model_lock, self.run_dir, model_dir,
                                     version)
            self.rollout = build_rollout_pool(cfg, p.tokenizer, p.env, p.sampling)
        # where everything runs, once: a learner's "cuda" resolves to the thread's current GPU (model._device),
        # and a bench process whose earlier run left another GPU current once ran a "dedicated" row with its
        # learner on the engine's GPU, sharing it (2 x H200, 2026-11-29, bench/results/logs/s45_*_run1.log)
        log.info("placement: learner on %s; engines: %s", p.learner.device,
                 ", ".join(f"{s.name} on {s.device}" if s.device else s.name for s in self.slots))
        self.front = build_front(cfg, self.slots, self.rollout)
        log.info("generation: %s batching", self.front.batching)  # auto resolves here: say what it chose
        self.rollout.attach(self.front)
        self._closers.append(self.stop_pools)
        if not all(isinstance(s.sync, SharedWeights) for s in self.slots):
            self.front.publish(weight_update(p.learner, version, self.slots))  # HTTP engines start at these weights
        judge = p.env.reward_fn if cfg.reward == "judge" else None  # the JudgeReward built with the policy
        if self.ray is not None and self.ray.reward is not None:  # the judge in its actor
            self.reward = self.ray.reward
        else:
            self.reward = build_reward_pool(cfg, judge, p.env.task if judge is not None else None,
                                            self.model_lock if cfg.judge_engine == "self" else None)
        self.worker = TrainWorker(cfg, p.learner, p.tokenizer, self.front, self.slots, self.model_lock, version, carry)
        self.train_pool = self.worker.pool()
        self.coord = Coordinator(cfg, version, ResumeState.from_checkpoint(extra, version, cfg.prompts_per_step),
                                 group_seed_fn(cfg, carry.v_star), self.rollout, self.reward, self.train_pool)
        self.learner_device = device_name(p.learner.device)
        self.gil = GilProbe().start()  # perf/gil_lag_max_s: a native call holding the interpreter lock shows here
        self._closers.append(self.gil.stop)
        # gpu/idle_share is the idle share of the devices our engines and learner use: GPUs, or the CPU here
        self.idle_label = "GPU" if self.learner_device.startswith("cuda") else "CPU"
        self._prev = self._snapshot()
        self._t0 = self._prev["t"]
        return self

    # ------------------------------------------------------------------------------------ per update

    def on_trained(self, res: TrainResult | Failure) -> None:
        from thinkcraft.train.llm_policy.learner import checkpoint_state
        from thinkcraft.train.llm_policy.rollout import episode_record

        if isinstance(res, Failure):
            raise UserError(f"the learner failed ({res.reason}: {res.detail}); the last checkpoint is intact")
        timeline = self.coord.trained(res)
        if self.writer is not None:
            for e, tid, stale in zip(res.trajectories, res.traj_ids, res.staleness):
                rec = episode_record(e, self.cfg.env, min(t.policy_version for t in e.turns),
                                     {"algo": self.cfg.algo, "traj_id": tid, "staleness": stale})
                # under the update that trained it (1-based, as metrics.jsonl and the sync loop count): a resume
                # drops the partitions after its checkpoint (loop._open_store)
                self.writer.add(rec, learner_step=res.version)
        # with each group's schedule: [admitted s, learner version then, finished s] (async_loop.batch_timeline)
        self.journal.write(json.dumps({"step": res.version, "groups": res.groups, "traj_ids": res.traj_ids,
                                       "staleness": res.staleness, "group_times": timeline["times"],
                                       "batch_sent_s": timeline["batch_sent_s"]}) + "\n")
        self.journal.flush()
        rec = self._metrics(res)
        rec.update({k: v for k, v in timeline.items() if k.startswith("rollout/")})
        self.session.log(res.version, res.version, rec, reward=rec["reward/mean"], stale=rec["staleness/mean"],
                         queue=rec["queue/rollout_queued"] + rec["queue/rollout_running"],
                         buffer=rec["queue/buffer_groups"], samples_s=rec["perf/samples_per_s"],
                         **{f"{self.idle_label.lower()}_idle": rec["gpu/idle_share"]})
        self.checkpoint(force=False)

    def checkpoint(self, force: bool) -> None:
        """A checkpoint between two updates (the learner idle) when due; the store flushed before it commits."""
        from thinkcraft.train.llm_policy.learner import checkpoint_state

        v = self.coord.version
        if self.coord.training is not None or not self.session.checkpoint_due(v, force):
            return
        if self.writer is not None:
            self.writer.flush()
        extra = {**self.worker.carry._asdict(), "async": self.coord.state()}
        self.session.save_checkpoint(v, v, checkpoint_state(self.policy.learner, v, extra))

    def _snapshot(self) -> dict[str, Any]:
        pools = {"rollout": self.rollout.health(), "train": self.train_pool.health()}
        if self.reward is not None:
            pools["reward"] = self.reward.health()
        return {"t": time.perf_counter(), "engine": self.front.stats(), "pools": pools,
                "learner_busy_s": self.worker.busy_s, "decode": self._decode_counters()}

    def _decode_counters(self) -> dict[str, float]:
        """The decode counters of every engine that keeps them (in-process engines, Ray engine actors), summed;
        HTTP engines keep theirs on the server."""
        total: dict[str, float] = {}
        for s in self.slots:
            if not callable(getattr(s.engine, "decode_metrics", None)):
                continue
            got = s.engine.decode_metrics()
            for k, v in (got.items() if isinstance(got, dict) else ()):
                total[k] = total.get(k, 0.0) + float(v)
        return total

    def _metrics(self, res: TrainResult) -> dict[str, Any]:
        """The synchronous loop's step metrics over the interval since the previous update, plus staleness,
        queues, busy and idle shares and failures."""
        import numpy as np

        from thinkcraft.train.llm_policy.loop import _step_metrics
        from thinkcraft.train.llm_policy.rollout import decode_metrics_delta, rollout_metrics

        now = self._snapshot()
        prev, self._prev = self._prev, now
        dt = max(now["t"] - prev["t"], 1e-9)
        timer = PhaseTimer()
        timer.add("generate", sum(now["engine"].busy_s) - sum(prev["engine"].busy_s))
        timer.add("train", res.train_s)
        rec = _step_metrics(self.cfg, self.policy.env, res.trajectories, dt, timer)
        rec.update({"policy_version": res.version, **res.stats, **timer.metrics(), **rollout_metrics(res.trajectories)})
        stale = np.asarray(res.staleness)
        rec["staleness/mean"], rec["staleness/max"] = float(stale.mean()), int(stale.max())
        for k in range(self.cfg.max_staleness + 1):
            rec[f"staleness/hist_{k}"] = int((stale == k).sum())
        rec.update(pool_metrics(prev, now, dt, self.coord, self.slots, self.learner_device))
        rec["perf/gil_lag_max_s"] = self.gil.take_max()  # the longest time no Python thread could run
        # when this update ended and began (seconds since the pools started): with the queue depths, a timeline of
        # whether generation and updates overlapped
        rec["timeline/end_s"] = now["t"] - self._t0
        rec["timeline/train_start_s"] = rec["timeline/end_s"] - res.train_s
        if now["decode"]:
            rec.update(decode_metrics_delta(prev["decode"], now["decode"]))
        return rec

    # ---------------------------------------------------------------------------------------- stop

    def stop_pools(self) -> None:
        """Stop every pool (rollouts in flight are abandoned: played again on resume); idempotent."""
        self.rollout.stop(drain=False, timeout_s=0.0)  # first mark the workers stopping (their groups: "stopped"),
        self.front.stop(timeout_s=10.0)  # then release the ones waiting for the engine,
        self.rollout.stop(drain=False, timeout_s=10.0)  # then wait for them
        if self.reward is not None:
            self.reward.stop(drain=False, timeout_s=10.0)
        self.train_pool.stop(drain=True, timeout_s=60.0)

    def close(self) -> None:
        for c in reversed(self._closers):
            c()
        self._closers.clear()


def pool_metrics(prev: dict[str, Any], now: dict[str, Any], dt: float, coord: Any, slots: list[Any],
                 learner_device: str) -> dict[str, Any]:
    """Queue depths now; busy and idle shares over the interval `dt` since `prev`; failures so far."""
    import numpy as np

    out: dict[str, Any] = {}
    ro = now["pools"]["rollout"]
    out["queue/rollout_queued"], out["queue/rollout_running"] = ro.queued, ro.running
    out["queue/buffer_groups"] = len(coord.buffer)
    if "reward" in now["pools"]:
        out["queue/reward"] = now["pools"]["reward"].queued + now["pools"]["reward"].running
    for name, h in now["pools"].items():
        out[f"pool/{name}_busy"] = (h.busy_s - prev["pools"][name].busy_s) / max(h.workers * dt, 1e-9)
    e0, e1 = prev["engine"], now["engine"]
    busy = [b1 - b0 for b0, b1 in zip(e0.busy_s, e1.busy_s)]
    out["engine/idle_share"] = 1.0 - sum(busy) / max(len(busy) * dt, 1e-9)
    out["engine/batches"] = e1.batches
    out["engine/mean_batch_rows"] = (e1.rows - e0.rows) / max(e1.batches - e0.batches, 1)
    out["engine/min_version"] = min(e1.versions)
    out["weights/update_failures"] = e1.update_failures
    # seconds per weight update an engine with its own copy took over the interval (copy + load; shared engines
    # take theirs for free and are left out): issue 21's weight-sync time
    own = [k for k, s in enumerate(slots) if not isinstance(s.sync, SharedWeights)]
    n_upd = sum(e1.updates[k] - e0.updates[k] for k in own)
    if n_upd:
        out["weights/update_s"] = sum(e1.update_s[k] - e0.update_s[k] for k in own) / n_upd
    # per device: its engines' generate time plus the learner's update time if it lives there
    per_device: dict[str, float] = {}
    for s, b in zip(slots, busy):
        if s.device is not None:  # remote engines' devices are not ours to count
            per_device[s.device] = per_device.get(s.device, 0.0) + b
    learner_busy = now["learner_busy_s"] - prev["learner_busy_s"]
    per_device[learner_device] = per_device.get(learner_device, 0.0) + learner_busy
    out["gpu/idle_share"] = float(np.mean([1.0 - min(1.0, b / dt) for b in per_device.values()]))
    out["rollout/failed"] = sum(v for k, v in coord.counts.items() if k.startswith("rollout/failed/"))
    out.update(coord.counts)
    out["rollout/restarts"] = ro.restarts
    return out
