"""utils/watchdog.py: a loop without progress leaves every thread's stack in a file, once per stall."""

import threading
import time

from thinkcraft.utils.watchdog import StallWatchdog


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
        # every thread: this one, the watchdog's and the stuck worker, waiting in threading's wait
        assert text.count("hread 0x") >= 3 and "in wait" in text
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
