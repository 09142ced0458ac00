"""utils/watchdog.py: a loop without progress leaves every thread's stack in a file, once per stall."""

import threading
import time

from thinkcraft.utils.watchdog import StallWatchdog, dump_stacks_later, thread_stacks


def test_a_stall_dumps_every_threads_stack_once_and_a_beat_rearms(tmp_path, caplog):
    path = tmp_path / "stalls.txt"
    blocker = threading.Event()
    t = threading.Thread(target=blocker.wait, name="stuck-worker", daemon=True)
    t.start()
    with StallWatchdog(1.0, path, "learner step") as wd:
        time.sleep(1.4)  # stalled: a dump (the next only after another 1.0 s of the same stall)
        assert wd.stalls >= 1 and path.exists()
        text = path.read_text()
        assert "no learner step for" in text
        # every thread by name: this one, the watchdog's and the stuck worker, waiting in threading's wait
        assert "Thread stuck-worker (daemon)" in text and "Thread stall-watchdog" in text
        assert "Thread MainThread" in text and "in wait" in text
        wd.beat()
        n = wd.stalls
        time.sleep(0.3)
        assert wd.stalls == n  # progress: no dump
    blocker.set()
    assert any("every thread's stack written to" in r.getMessage() for r in caplog.records)


def test_off_at_zero(tmp_path):
    with StallWatchdog(0, tmp_path / "s.txt", "x") as wd:
        time.sleep(0.05)
    assert wd.stalls == 0 and not (tmp_path / "s.txt").exists() and wd._thread is None


def test_llm_policy_stall_dump_is_validated_and_async_only():
    import pytest

    from thinkcraft.train.llm_policy import LLMPolicyConfig
    from thinkcraft.train.llm_policy.async_loop import check_async_config
    from thinkcraft.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="stall-dump-s.*must be >= 0"):
        LLMPolicyConfig(model="random:tiny", mode="async", stall_dump_s=-1).validate()
    assert check_async_config(LLMPolicyConfig(model="random:tiny", mode="async", stall_dump_s=60)) is None
    with pytest.raises(ConfigError, match="stall-dump-s.*asynchronous loop only"):
        LLMPolicyConfig(model="random:tiny", stall_dump_s=60)  # sync mode


def test_deep_stacks_keep_both_ends_and_the_timer_dump_names_threads(tmp_path):
    """A compile runs hundreds of frames deep: the dump keeps the outermost frames (which of our threads, from
    where) as well as the innermost (what it does), which faulthandler's innermost-100 did not."""
    release, deepest = threading.Event(), threading.Event()

    def bottom():
        deepest.set()
        return release.wait()

    def deeper(n):  # two functions in turn: traceback folds identical repeated frames, not alternating ones
        return outermost_marker(n - 1) if n > 0 else bottom()

    def outermost_marker(n):
        return deeper(n - 1)

    t = threading.Thread(target=outermost_marker, args=(200,), name="deep-worker", daemon=True)
    t.start()
    assert deepest.wait(10)  # at the bottom of its 200 frames (not a fixed sleep: CI machines run loaded)
    text = thread_stacks(ends=10)
    block = text.split("Thread deep-worker")[1].split("\nThread ")[0]
    assert "frames ..." in block and "in outermost_marker" in block and "in wait" in block
    assert block.count("\n  File ") <= 21  # 10 + 10 frames + the elision line
    out = tmp_path / "dump.txt"
    with open(out, "w") as f:
        timer = dump_stacks_later(0.2, file=f)
        time.sleep(0.5)
    release.set()
    timer.cancel()
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    dumped = out.read_text()
    assert "every thread's stack at 0 s" in dumped and "Thread deep-worker" in dumped


def test_gil_probe_measures_a_native_call_that_holds_the_interpreter_lock(caplog):
    """`sum(range(n))` runs in C without releasing the GIL: the probe's thread cannot wake meanwhile, and says
    how long (perf/gil_lag_max_s in the async loop's metrics, a warning past warn_s)."""
    from thinkcraft.utils.watchdog import GilProbe

    probe = GilProbe(interval_s=0.005, warn_s=0.15).start()
    try:
        time.sleep(0.05)
        probe.take_max()  # start from here
        n = 2_000_000
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:  # one native call of at least ~0.3 s on this machine
            n *= 2
            t0 = time.perf_counter()
            sum(range(n))
        held = time.perf_counter() - t0
        time.sleep(0.05)  # the probe wakes, late, and records it
        lag = probe.take_max()
        assert lag >= 0.5 * held, (lag, held)
        assert probe.take_max() < lag  # take_max resets
        assert probe.lags_over_warn >= 1
        assert any("no Python thread could run for" in r.getMessage() for r in caplog.records)
    finally:
        probe.stop()
    assert not probe._thread.is_alive()
