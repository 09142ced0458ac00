"""Pools (CPU, no model): the local backend's contract, the staleness rule, env handles under faults, the
engine front's batching / versions / weight-update failures, the rollout pool with a scripted engine."""

import os
import pickle
import random
import signal
import threading
import time

import pytest

from thinkcraft.llm.protocol import Completion, SamplingParams, WeightUpdateError
from thinkcraft.pools import staleness as S
from thinkcraft.pools import (
    CopyWeights, EngineFront, EngineSlot, EnvFault, EnvSpec, Failure, GroupRequest, GroupResult, LocalPool,
    ProcessEnv, ReadyBuffer, RolloutPool, RolloutSettings, SharedWeights, ThreadEnv, Trajectory, WeightUpdate,
    WorkFailed, group_has_signal, split_results,
)

# ----------------------------------------------------------------------------------------- LocalPool


def _drain(pool, n, timeout_s=10.0):
    out, t0 = [], time.perf_counter()
    while len(out) < n and time.perf_counter() - t0 < timeout_s:
        out += pool.poll(64, 0.2)
    return out


def test_local_pool_results_failures_and_crash_replacement():
    def handler(x, ctx):
        if x == 3:
            raise WorkFailed("env_error", "three")
        if x == 5:
            raise RuntimeError("boom")  # a crash: the item fails, the worker is replaced
        return x * 10

    pool = LocalPool("t", handler, num_workers=2, max_queued=4)
    for i in range(8):
        assert pool.submit(i)
    ok, bad = split_results(_drain(pool, 8))
    assert sorted(ok) == [0, 10, 20, 40, 60, 70]
    assert sorted((f.request, f.reason) for f in bad) == [(3, "env_error"), (5, "worker_crashed")]
    h = pool.health()
    assert h.completed == 6 and h.failed == {"env_error": 1, "worker_crashed": 1} and h.restarts == 1
    assert h.workers == 2 and h.busy_s >= 0 and 0 <= h.busy_share <= 1
    pool.stop()


def test_local_pool_backpressure_and_stop_reports_abandoned_items():
    gate, holding = threading.Event(), threading.Event()
    pool = LocalPool("t", lambda x, ctx: (holding.set(), gate.wait(5))[1] and x, num_workers=1, max_queued=2)
    assert pool.submit(0)
    assert holding.wait(10)  # the worker holds item 0
    assert pool.submit(1) and pool.submit(2)
    assert not pool.submit(3, timeout_s=0.1)  # the queue is full: backpressure, not growth
    pool.stop(drain=False, timeout_s=0.1)
    gate.set()
    time.sleep(0.3)
    res = _drain(pool, 3, 2.0)
    # nothing vanishes: the running item finishes (its result comes back), the queued ones come back stopped
    ok, bad = split_results(res)
    assert ok == [0] and sorted(f.request for f in bad) == [1, 2] and {f.reason for f in bad} == {"stopped"}


def test_local_pool_drain_finishes_queued_items_and_batches():
    pool = LocalPool("t", lambda xs, ctx: [x + 1 for x in xs], num_workers=1, max_queued=8, max_batch=4)
    for i in range(6):
        pool.submit(i)
    pool.stop(drain=True)
    assert sorted(_drain(pool, 6, 2.0)) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------------------- staleness


def test_staleness_admission_hand_computed():
    s = S.StalenessState(max_staleness=0, batch_size=8)
    assert S.capacity(s, 0) == 8 and S.can_admit(s, 0, 4)
    s = S.on_start(S.on_start(s, 4), 4)  # one batch of two groups of 4 is running
    assert not S.can_admit(s, 0, 4)  # η = 0: nothing more until the learner moves
    s = S.on_accept(s, 8)
    assert not S.can_admit(s, 0, 4) and S.can_admit(s, 1, 4) and S.capacity(s, 1) == 8
    s1 = S.StalenessState(max_staleness=1, batch_size=8)
    assert S.capacity(s1, 0) == 16  # η = 1: the next batch may be generated while this one trains
    s1 = S.on_reject(S.on_start(s1, 4), 4)  # a dropped group frees its place
    assert S.capacity(s1, 0) == 16 and s1.accepted == 0
    with pytest.raises(ValueError):
        S.on_accept(s1, 1)
    r = S.resumed(S.StalenessState(1, 8, accepted=40, running=12), version=4)
    assert (r.accepted, r.running) == (32, 0)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_bound_holds_in_a_random_schedule(eta):
    """Groups finish in random order (one may straggle), the learner consumes B at a time taking the oldest
    first and discarding the too-stale: every trained trajectory is at most η versions old, and the rule
    keeps the learner fed (20 updates happen)."""
    rng = random.Random(eta)
    G, B = 2, 8
    s, version, running, ready, trained, discarded = S.StalenessState(eta, B), 0, [], [], 0, 0
    for _ in range(100_000):
        if version == 20:
            break
        while S.can_admit(s, version, G):
            s = S.on_start(s, G)
            running.append(version)
        if running and rng.random() < 0.7:
            v0 = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.1:
                s = S.on_reject(s, G)  # a failed / no-signal group
            else:
                s = S.on_accept(s, G)
                ready.append(v0)
        stale = [v0 for v0 in ready if S.too_stale(s, version, v0)]
        if stale:
            ready = [v0 for v0 in ready if not S.too_stale(s, version, v0)]
            s = S.on_discard(s, G * len(stale))
            discarded += len(stale)
        if len(ready) * G >= B and rng.random() < 0.5:
            ready.sort()
            batch, ready = ready[: B // G], ready[B // G:]
            assert all(S.staleness_of(version, v0) <= eta for v0 in batch)
            version += 1
            trained += B
        if eta == 0:
            assert len(running) * G + len(ready) * G <= B
    assert trained == 20 * B and discarded <= 20 * B // G // 4


# ------------------------------------------------------------------------------------------- buffer


def _group(gid, rewards):
    req = GroupRequest(gid, seed=gid, num_samples=len(rewards))
    trajs = [Trajectory(gid, gid, k) for k in range(len(rewards))]
    from thinkcraft.pools import TurnRecord

    for t, r in zip(trajs, rewards):
        t.turns.append(TurnRecord("o", [1], [2], [-0.5], [1], "x", "stop", policy_version=0, reward=r))
    return GroupResult(req, trajs)


def test_dynamic_sampling_signal_and_lowest_ids_first():
    assert not group_has_signal([1.0, 1.0, 1.0]) and not group_has_signal([0.0, 0.0])
    assert group_has_signal([0.0, 1.0]) and not group_has_signal([])
    b = ReadyBuffer()
    for gid in (5, 2, 9):
        b.add(_group(gid, [0.0, 1.0]))
    with pytest.raises(ValueError, match="at most once"):
        b.add(_group(2, [0.0, 1.0]))
    assert b.take(4) is None
    assert [g.request.group_id for g in b.take(2)] == [2, 5] and b.group_ids() == [9] and b.trajectories == 2


def test_contract_values_are_picklable():
    g = _group(3, [0.0, 1.0])
    g2 = pickle.loads(pickle.dumps(g))
    assert g2.trajectories[1].turns[0].reward == 1.0 and g2.request == g.request
    assert pickle.loads(pickle.dumps(Failure(g.request, "env_crashed", "x"))).reason == "env_crashed"
    assert pickle.loads(pickle.dumps(EnvSpec("arith", latency_ms=5))).latency_ms == 5


# -------------------------------------------------------------------------------------------- envs


def test_thread_env_step_timeout_and_rebuild():
    env = ThreadEnv(EnvSpec("arith", latency_ms=2000))
    obs = env.call("reset", ([1, 1],), 5.0)
    assert len(obs) == 2 and "####" in env.system_prompt
    with pytest.raises(EnvFault) as e:
        env.call("step", (["#### 1", "#### 2"],), 0.2)
    assert e.value.reason == "env_step_timeout" and env.restarts == 1
    assert len(env.call("reset", ([2],), 5.0)) == 1  # a fresh env for the next group


def test_latency_env_waits_and_steps_a_subset_of_episodes():
    """The slow env of the benchmarks keeps the text-env protocol: the synchronous loop's continuous rollout
    steps the episodes whose turn came back (`indices`)."""
    env = EnvSpec("arith", latency_ms=30).build()
    env.reset([1, 2, 3])
    t0 = time.perf_counter()
    res = env.step(["#### 1"], indices=[1])
    assert time.perf_counter() - t0 >= 0.03 and len(res.rewards) == 1
    assert env.active_indices() == [0, 2]  # a one-turn task: episode 1 is done, the others wait for theirs
    assert len(env.step(["#### 1", "#### 2"]).rewards) == 2 and env.active_indices() == []


def test_process_env_killed_mid_episode_and_hung_step_are_replaced():
    env = ProcessEnv(EnvSpec("arith"))
    try:
        env.call("reset", ([7, 7],), 60.0)
        os.kill(env.pid, signal.SIGKILL)  # the env worker dies mid-episode
        with pytest.raises(EnvFault) as e:
            env.call("step", (["#### 1", "#### 2"],), 10.0)
        assert e.value.reason == "env_crashed"
        pid_before = None
        env.call("reset", ([7],), 60.0)  # a new process takes over
        pid_before = env.pid
        res = env.call("step", (["#### 1"],), 10.0)
        assert len(res.rewards) == 1
        slow = ProcessEnv(EnvSpec("arith", latency_ms=5000))
        try:
            slow.call("reset", ([1],), 60.0)
            hung_pid = slow.pid
            with pytest.raises(EnvFault) as e:
                slow.call("step", (["#### 1"],), 0.3)
            assert e.value.reason == "env_step_timeout" and slow.pid is None and slow.restarts == 1
            with pytest.raises(ProcessLookupError):
                os.kill(hung_pid, 0)  # the hung process was killed, not leaked
        finally:
            slow.close()
        assert env.pid == pid_before
    finally:
        env.close()


# -------------------------------------------------------------------------------------- engine front


class ScriptedEngine:
    """Answers '#### <number of prompt tokens>'; records each batch; can fail on demand."""

    def __init__(self, delay_s=0.0):
        self.batches = []
        self.fail_next = 0
        self.delay_s = delay_s

    def generate(self, batch, sampling):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected engine failure")
        time.sleep(self.delay_s)
        self.batches.append([list(p) for p in batch.items])
        return [Completion(token_ids=[5, 6], text=f"#### {len(p)}", logprobs=[-0.5, -0.25], finish_reason="stop",
                           prompt_token_ids=list(p)) for p in batch.items]


SP = SamplingParams(max_new_tokens=2)


def generate(front, *args, **kw):
    """(completions, the oldest weight version that made them) of `front.run(*args, **kw)`."""
    res = front.run(*args, **kw)
    return [r.completion for r in res], min(r.weight_versions[0][1] for r in res)


def test_front_barrier_batches_in_key_order_and_reports_the_version():
    eng = ScriptedEngine()
    expected = {"rows": 3}
    front = EngineFront([EngineSlot(eng, SharedWeights(4))], batch_wait_s=30.0, expected_rows=lambda: expected["rows"])
    out = {}

    def ask(key, prompt):
        out[key] = generate(front, [prompt], [key], SP, timeout_s=10)

    threads = [threading.Thread(target=ask, args=(k, [k] * (k + 1))) for k in (2, 0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(10)
    # one batch (the barrier: all three expected rows waited), rows in key order whatever the arrival order
    assert eng.batches == [[[0], [1, 1], [2, 2, 2]]]
    assert out[1][0][0].text == "#### 2" and out[1][1] == 4
    front.stop()


def test_front_flushes_stragglers_after_the_wait():
    eng = ScriptedEngine()
    front = EngineFront([EngineSlot(eng, SharedWeights())], batch_wait_s=0.05, expected_rows=lambda: 10)
    comps, v = generate(front, [[1, 2]], [0], SP, timeout_s=5)
    assert comps[0].text == "#### 2" and v == 0 and len(eng.batches) == 1
    st = front.stats()
    assert st.batches == 1 and st.rows == 1 and 0.0 <= st.idle_share <= 1.0
    front.stop()


class FlakySync:
    """A weight sync that fails its first `fails` applies (the update does not happen)."""

    def __init__(self, fails):
        self.fails, self._version, self.calls = fails, 0, 0

    @property
    def version(self):
        return self._version

    def apply(self, update):
        self.calls += 1
        if self.fails:
            self.fails -= 1
            raise ConnectionError("injected: server went away during the load")
        self._version = update.version


def test_failed_weight_update_keeps_old_version_and_retries(caplog):
    eng = ScriptedEngine()
    sync = FlakySync(fails=2)
    front = EngineFront([EngineSlot(eng, sync)], batch_wait_s=0.0, max_lag=0, update_backoff_s=0.05)
    front.publish(WeightUpdate(1))
    with caplog.at_level("WARNING"):
        _, v = generate(front, [[1]], [0], SP, timeout_s=10)
    # max_lag 0: nothing was generated on version 0 after version 1 was published; it waited for the retry
    assert v == 1 and sync.calls == 3 and front.stats().update_failures == 2
    assert "keeps version 0" in caplog.text and "retries" in caplog.text
    front.stop()


def test_weight_update_failing_for_good_is_a_clear_error_not_a_hang():
    front = EngineFront([EngineSlot(ScriptedEngine(), FlakySync(fails=99))], batch_wait_s=0.0, max_lag=0,
                        update_backoff_s=0.01, max_update_failures=3)
    front.publish(WeightUpdate(1))
    with pytest.raises(Exception, match="failed 3 times in a row"):
        generate(front, [[1]], [0], SP, timeout_s=10)
    assert "still at version 0" in front.fatal
    front.stop()


def test_engine_error_fails_the_batch_and_the_next_one_works():
    eng = ScriptedEngine()
    eng.fail_next = 1
    front = EngineFront([EngineSlot(eng, SharedWeights())], batch_wait_s=0.0)
    with pytest.raises(Exception, match="injected engine failure"):
        generate(front, [[1]], [0], SP, timeout_s=5)
    assert generate(front, [[1]], [0], SP, timeout_s=5)[0][0].text == "#### 1"
    assert front.stats().generate_failures == 1
    front.stop()


def test_copy_weights_checks_everything_before_changing_anything():
    import torch

    model = torch.nn.Linear(2, 2)
    sync = CopyWeights(model, version=0)
    good = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    bad = dict(good, bias=torch.ones(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(WeightUpdateError, match="shape"):
        sync.apply(WeightUpdate(1, bad))
    assert sync.version == 0 and all(torch.equal(before[n], p) for n, p in model.named_parameters())
    sync.apply(WeightUpdate(2, good))
    assert sync.version == 2 and all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())
    sync.apply(WeightUpdate(1, {n: torch.zeros_like(p) for n, p in model.named_parameters()}))
    assert sync.version == 2 and float(model.weight.detach().sum()) == 4.0  # an older update is ignored


# ------------------------------------------------------------------------------------- rollout pool


class ObsPrompts:
    """A group's prompts as a function of each observation alone (the pool's GroupPrompts contract)."""

    def __init__(self, fn):
        self.fn = fn

    @classmethod
    def of(cls, fn):
        return lambda system, n: cls(fn)

    def next(self, idx, obs, comps):
        return [self.fn(o) for o in obs]


def _rollout_pool(env_spec, workers=2, engine=None, env_mode="thread", **kw):
    eng = engine or ScriptedEngine()
    settings = RolloutSettings(env=env_spec, sampling=SP, env_mode=env_mode, **kw)
    pool = RolloutPool(settings, ObsPrompts.of(lambda o: [1] * (len(o) % 7 + 1)), num_workers=workers,
                       max_queued=8, group_size=2)
    front = EngineFront([EngineSlot(eng, SharedWeights(3))], batch_wait_s=0.05, expected_rows=pool.expected_rows)
    pool.attach(front)
    return pool, front, eng


def test_rollout_pool_plays_groups_with_versions_and_engine_tokens():
    pool, front, eng = _rollout_pool(EnvSpec("arith", format_weight=0.1))
    for gid in range(3):
        pool.submit(GroupRequest(gid, seed=100 + gid, num_samples=2))
    res = _drain(pool, 3)
    ok, bad = split_results(res)
    assert not bad and sorted(g.request.group_id for g in ok) == [0, 1, 2]
    g = min(ok, key=lambda g: g.request.group_id)
    assert [t.traj_id for t in g.trajectories] == ["g0s0", "g0s1"] and g.scored
    t = g.trajectories[0].turns[0]
    assert t.completion_ids == [5, 6] and t.logprobs == [-0.5, -0.25] and t.policy_version == 3
    assert t.train_mask == [1, 1] and t.reward == pytest.approx(0.1) and t.version_switch_at is None
    pool.stop()
    front.stop()


def test_rollout_pool_drops_and_counts_a_hung_env_and_a_failed_engine_call():
    pool, front, eng = _rollout_pool(EnvSpec("arith", latency_ms=1500), workers=1, step_timeout_s=0.3)
    pool.submit(GroupRequest(0, seed=1, num_samples=2))
    (f,) = _drain(pool, 1)
    assert isinstance(f, Failure) and f.reason == "env_step_timeout"
    pool.stop()
    front.stop()
    pool, front, eng = _rollout_pool(EnvSpec("arith"), workers=1)
    eng.fail_next = 1
    pool.submit(GroupRequest(0, seed=1, num_samples=2))
    pool.submit(GroupRequest(1, seed=2, num_samples=2))
    res = _drain(pool, 2)
    assert [type(r).__name__ for r in res] == ["Failure", "GroupResult"] and res[0].reason == "engine_error"
    assert pool.health().failed == {"engine_error": 1}
    pool.stop()
    front.stop()


def test_rollout_pool_with_process_envs_replaces_a_killed_env_worker():
    pool, front, eng = _rollout_pool(EnvSpec("arith", latency_ms=1000), workers=1, env_mode="process")
    pool.submit(GroupRequest(0, seed=1, num_samples=2))
    (g0,) = _drain(pool, 1, 60)
    assert isinstance(g0, GroupResult)
    pool.submit(GroupRequest(1, seed=2, num_samples=2))
    time.sleep(0.3)  # the worker is inside its 1 s env step (room for a loaded CI machine on either side)
    os.kill(pool._envs[0].pid, signal.SIGKILL)
    (f,) = _drain(pool, 1, 60)
    assert isinstance(f, Failure) and f.reason == "env_crashed" and f.request.group_id == 1
    pool.submit(GroupRequest(1, seed=2, num_samples=2, attempt=1))  # played again under the same id
    (g1,) = _drain(pool, 1, 60)
    assert isinstance(g1, GroupResult) and g1.request.attempt == 1 and pool.health().restarts >= 1
    pool.stop()
    front.stop()


def test_rollout_pool_engine_call_timing_out_fails_the_group_and_the_next_one_works():
    slow = ScriptedEngine(delay_s=1.0)
    pool, front, eng = _rollout_pool(EnvSpec("arith"), workers=1, engine=slow, engine_timeout_s=0.3)
    pool.submit(GroupRequest(0, seed=1, num_samples=2))
    (f,) = _drain(pool, 1)
    assert isinstance(f, Failure) and f.reason == "engine_error" and "within 0.3s" in f.detail
    slow.delay_s = 0.0
    time.sleep(1.0)  # the timed-out batch finishes in the engine thread; its answer is dropped
    pool.submit(GroupRequest(0, seed=1, num_samples=2, attempt=1))
    (g,) = _drain(pool, 1)
    assert isinstance(g, GroupResult)
    pool.stop()
    front.stop()


def test_buffer_remove_where():
    b = ReadyBuffer()
    for gid in (1, 2, 3):
        b.add(_group(gid, [0.0, 1.0]))
    assert [g.request.group_id for g in b.remove_where(lambda g: g.request.group_id != 2)] == [1, 3]
    assert b.group_ids() == [2]


def _idle_share_with_slow_env(workers: int, max_batch_rows: int, seconds: float = 2.5) -> float:
    """A 50 ms-per-batch engine (a GPU-bound engine's shape) and a 100 ms env step: the engine's idle share
    while `workers` rollout workers (2 rows each) keep playing groups."""
    slow_engine = ScriptedEngine(delay_s=0.05)
    settings = RolloutSettings(env=EnvSpec("arith", latency_ms=100), sampling=SP)
    pool = RolloutPool(settings, ObsPrompts.of(lambda o: [1, 2, 3]), num_workers=workers, max_queued=2 * workers,
                       group_size=2)
    front = EngineFront([EngineSlot(slow_engine, SharedWeights())], batch_wait_s=0.02, max_batch_rows=max_batch_rows,
                        expected_rows=pool.expected_rows)
    pool.attach(front)
    t0, gid, s0 = time.perf_counter(), 0, None
    while time.perf_counter() - t0 < seconds:
        while pool.submit(GroupRequest(gid, seed=gid, num_samples=2), timeout_s=0.0):
            gid += 1
        pool.poll(256, 0.02)
        if s0 is None and time.perf_counter() - t0 > 0.5:  # past the start-up
            s0 = front.stats()
    s1 = front.stats()
    pool.stop()
    front.stop()
    return 1.0 - (s1.busy_s[0] - s0.busy_s[0]) / (s1.wall_s - s0.wall_s)


def test_a_slow_env_keeps_the_engine_busy_given_enough_workers():
    """With whole-call batching, workers whose rows all fit one batch step their envs in lockstep and the
    engine waits for the env (idle ~ env / (env + generate)); once their rows exceed a batch, some groups step
    while others generate and the engine stays busy. (Continuous batching, issue 19, removes the lockstep.)"""
    one = _idle_share_with_slow_env(1, max_batch_rows=8)
    many = _idle_share_with_slow_env(12, max_batch_rows=8)
    assert one > 0.5  # one worker: the engine waits for the env two thirds of the time
    assert many < 0.2, many


def test_fair_lock_serves_a_waiter_between_two_steps_of_a_tight_loop():
    """The continuous slot thread takes the engine lock for every decode step; a learner asking for it (shared
    parameters) gets it after at most the step in progress and the next one, in ask order."""
    from thinkcraft.pools import FairLock

    lock, steps, got_at = FairLock(), [0], []
    stop = threading.Event()

    def stepping():
        while not stop.is_set():
            with lock:
                steps[0] += 1
                time.sleep(0.002)

    t = threading.Thread(target=stepping, daemon=True)
    t.start()
    time.sleep(0.05)
    for _ in range(5):
        before = steps[0]
        with lock:
            got_at.append(steps[0] - before)
        time.sleep(0.01)
    stop.set()
    t.join(5)
    assert max(got_at) <= 2, got_at


def test_continuous_front_serves_each_request_as_the_engine_generates_it_alone():
    """batching="continuous" over the hf engine: requests from several workers join one running decode batch
    and come back with the tokens greedy decoding gives each alone, their weight versions, and the rows per
    decode step counted; a request longer than the engine allows fails alone (its worker's group), the others
    are served."""
    import torch

    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.llm.testing import tiny_llama

    torch.manual_seed(0)
    engine = HFEngine.from_model(*tiny_llama(), max_seq_len=64)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [[1, 5, 9, 13], [1, 7, 7], [1, 2, 3, 4, 5, 6], [1, 40]]
    alone = [engine.generate(Batch(items=[p]), greedy)[0].token_ids for p in prompts]
    front = EngineFront([EngineSlot(engine, SharedWeights(2, engine))], batching="continuous")  # engine at v2
    out: dict = {}

    def ask(k):
        try:
            out[k] = front.run([prompts[k]], [(k, 0)], greedy, timeout_s=60, route=k, episodes=[(k, 0)])
        except Exception as e:  # noqa: BLE001
            out[k] = e

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    too_long = threading.Thread(target=lambda: out.setdefault("long", _call(front, [1] * 80, greedy)))
    too_long.start()
    for t in [*threads, too_long]:
        t.join(60)
    for k, p in enumerate(prompts):
        (res,) = out[k]
        assert res.completion.token_ids == alone[k] and res.weight_versions[0][1] == 2
    assert isinstance(out["long"], Exception) and "max_seq_len" in str(out["long"])
    st = front.stats()
    assert st.batches >= 6 and st.rows / st.batches > 1  # several requests decoded together
    front.release(0, [(0, 0)])
    front.stop()


def _call(front, prompt, sampling):
    try:
        return front.run([prompt], ["x"], sampling, timeout_s=60)
    except Exception as e:  # noqa: BLE001
        return e


def test_env_handles_report_the_built_envs_turns_and_the_cache_is_sized_by_them():
    """A single-turn task's KV cache holds one turn, whatever the spec's max_turns (a cap, default 8): sized
    for 8 turns, an arith cache read 8x the columns it needed at every static-width decode step (H100,
    2026-11-27: async decode steps ~3x sync's)."""
    from thinkcraft.pools.envproc import ProcessEnv, ThreadEnv

    spec = EnvSpec("arith", max_turns=8)
    for handle in (ThreadEnv(spec), ProcessEnv(spec)):
        handle.call("reset", ([1],), 60.0)
        assert handle.max_turns == 1 and handle.system_prompt
        handle.close()
    pool, front, _ = _rollout_pool(spec)
    calls = []
    pool.front = type("F", (), {"reserve": lambda self, rows, tokens, prefix=0, group_rows=0:
                                calls.append((rows, tokens, prefix))})()
    per_turn = 10 - 2 + SP.max_new_tokens + 16
    pool._reserve([1] * 10, 2, keep_kv=True, env_turns=1)
    pool._reserve([1] * 10, 2, keep_kv=True, env_turns=1)  # once per pool
    assert calls == [(pool.num_workers * 2, per_turn, 2)]
    pool._reserved = False
    pool._reserve([1] * 10, 2, keep_kv=True, env_turns=None)  # a handle that cannot tell: the spec's cap
    assert calls[-1][1] == per_turn * 8
    front.stop(timeout_s=5.0)
    pool.stop(drain=False, timeout_s=5.0)


def test_front_sizes_whole_batch_engines_that_ask_with_their_share() -> None:
    """`EngineFront.reserve` (continuous engines: every row, each); whole-batch engines only when they ask
    (`reserves_whole_batches`: Ray actors, whose caches otherwise grew - a decode-graph compile each time) and
    with their share of the rows (the static step computes every slot); other whole-batch engines are left
    alone."""
    from thinkcraft.pools.engine import EngineFront, EngineSlot
    from thinkcraft.pools.weights import SharedWeights

    class Eng:
        def __init__(self, asks: bool) -> None:
            self.reserves_whole_batches, self.calls = asks, []

        def reserve(self, rows: int, tokens: int, prefix: int = 0) -> None:
            self.calls.append((rows, tokens, prefix))

    actors = [Eng(True) for _ in range(3)]
    plain = Eng(False)
    front = EngineFront([EngineSlot(e, SharedWeights()) for e in actors + [plain]], batch_wait_s=0.0)
    assert front.sizes_caches
    front.reserve(100, 64, 8)
    assert [e.calls for e in actors] == [[(34, 64, 8)]] * 3 and plain.calls == []
    alone = EngineFront([EngineSlot(Eng(False), SharedWeights())], batch_wait_s=0.0)
    assert not alone.sizes_caches


def test_front_sizes_continuous_engines_with_their_share_and_a_group_over() -> None:
    """Continuous batching: one engine is sized for every row; K engines each for ceil(rows / K) + one group
    (the static decode step computes every slot: K engines sized for all rows did K times the work), never more
    than every row."""
    from thinkcraft.pools.engine import EngineFront, EngineSlot
    from thinkcraft.pools.weights import SharedWeights

    class Cont:
        capabilities = type("C", (), {"continuous_batching": True})()

        def __init__(self) -> None:
            self.calls = []

        def submit(self, request):  # noqa: ANN001, ANN201 - never called here
            raise AssertionError

        def reserve(self, rows: int, tokens: int, prefix: int = 0) -> None:
            self.calls.append((rows, tokens, prefix))

    def sized(k: int, rows: int, group: int) -> list:
        engines = [Cont() for _ in range(k)]
        front = EngineFront([EngineSlot(e, SharedWeights()) for e in engines], batching="continuous",
                            batch_wait_s=0.0)
        try:
            assert front.sizes_caches
            front.reserve(rows, 64, 8, group_rows=group)
        finally:
            front.stop()
        return [e.calls for e in engines]

    assert sized(1, 128, 4) == [[(128, 64, 8)]]
    assert sized(3, 384, 4) == [[(132, 64, 8)]] * 3
    assert sized(2, 10, 8) == [[(10, 64, 8)]] * 2  # never over every row


def test_whole_batch_engines_that_reserved_take_at_most_their_share() -> None:
    """A batch handed to an engine whose cache the front sized (its share of the rows) is cut at that share, so
    the cache never grows mid-run (each growth was a decode-graph capture, ~25 s, 4 x H200 2026-11-29); the rest
    goes to the other engines. Without a reservation a slot takes everything pending, as before."""

    class Actorish(ScriptedEngine):
        reserves_whole_batches = True

        def reserve(self, rows: int, tokens: int, prefix: int = 0) -> None:
            self.reserved = rows

    engines = [Actorish(delay_s=0.2), Actorish(delay_s=0.2)]
    front = EngineFront([EngineSlot(e, SharedWeights()) for e in engines], batch_wait_s=30.0,
                        expected_rows=lambda: 8)
    front.reserve(8, 64)
    assert [e.reserved for e in engines] == [4, 4]
    out: dict[int, str] = {}

    def ask(key: int) -> None:
        out[key] = generate(front, [[key] * (key + 1)], [key], SP, timeout_s=10)[0][0].text

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    sizes = [len(b) for e in engines for b in e.batches]
    assert out == {k: f"#### {k + 1}" for k in range(8)}  # every row answered, once
    assert sum(sizes) == 8 and max(sizes) <= 4 and all(e.batches for e in engines)  # cut at the share, both busy
    front.stop()
    plain = ScriptedEngine()
    front = EngineFront([EngineSlot(plain, SharedWeights())], batch_wait_s=30.0, expected_rows=lambda: 6)
    threads = [threading.Thread(target=generate, args=(front, [[k]], [k], SP), kwargs={"timeout_s": 10}) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [len(b) for b in plain.batches] == [6]  # no reservation: one batch of all the expected rows
    front.stop()
