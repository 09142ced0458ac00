"""The opt-in device timing (llm/hf/device_timing.py): phases and the gaps between them summed from their events, in
order, only once completed; the rollout's metrics turn the sums into per-phase means. A GPU run reads real events
(`bench/llm_policy_craftax.py` with THINKCRAFT_DEVICE_TIMING=1); here the events are stand-ins on a fake clock."""

from __future__ import annotations

import pytest

from thinkcraft.llm.hf.device_timing import DeviceTiming, device_timing_on, per_call_ms
from thinkcraft.train.llm_policy.rollout import decode_metrics_delta


class _Event:
    """A timed event at a given device time (ms), done once the clock has passed it."""

    def __init__(self, clock: dict, at_ms: float) -> None:
        self.clock, self.at = clock, at_ms

    def query(self) -> bool:
        return self.clock["now"] >= self.at

    def elapsed_time(self, other: "_Event") -> float:
        return other.at - self.at


def _timing(times: list[float], clock: dict) -> DeviceTiming:
    t = DeviceTiming("cuda:0")
    it = iter(times)
    t._event = lambda: _Event(clock, next(it))  # type: ignore[method-assign]
    return t


def test_phases_and_gaps_are_summed_in_order_once_completed() -> None:
    clock = {"now": 0.0}
    # a prefill 0-10 ms, two decode iterations 12-14 and 15-17, a prefill 30-35
    t = _timing([0, 10, 12, 14, 15, 17, 30, 35], clock)
    for kind in ("prefill", "decode", "decode", "prefill"):
        t.start(kind)
        t.end()
    c: dict[str, float] = {}
    clock["now"] = 14.5  # the second decode iteration not done yet: it and what follows wait
    t.harvest(c)
    assert c == pytest.approx({"dev_prefill_s": 0.010, "dev_prefill_n": 1, "dev_decode_s": 0.002, "dev_decode_n": 1,
                               "dev_gap_prefill_decode_s": 0.002, "dev_gap_prefill_decode_n": 1})
    clock["now"] = 100.0
    t.harvest(c)
    assert c["dev_decode_s"] == pytest.approx(0.004) and c["dev_decode_n"] == 2
    assert c["dev_gap_decode_decode_s"] == pytest.approx(0.001)
    assert c["dev_gap_decode_prefill_s"] == pytest.approx(0.013)
    assert c["dev_prefill_s"] == pytest.approx(0.015) and c["dev_prefill_n"] == 2
    m = per_call_ms(c)
    assert m["engine/dev_decode_ms"] == pytest.approx(2.0)
    assert m["engine/dev_gap_decode_prefill_ms"] == pytest.approx(13.0)
    assert m["engine/dev_prefill_s"] == pytest.approx(0.015)


def test_misuse_is_an_error_and_forget_starts_a_new_chain() -> None:
    clock = {"now": 100.0}
    t = _timing([0, 1, 50, 52], clock)
    with pytest.raises(RuntimeError, match="end\\(\\) without start"):
        t.end()
    t.start("decode")
    with pytest.raises(RuntimeError, match="still open"):
        t.start("prefill")
    t.end()
    c: dict[str, float] = {}
    t.harvest(c)
    t.forget()  # e.g. a failed step: the next phase has no gap to the old chain
    t.start("decode")
    t.end()
    t.harvest(c)
    assert c["dev_decode_n"] == 2 and "dev_gap_decode_decode_s" not in c


def test_the_switch_and_the_rollout_metrics(monkeypatch) -> None:
    monkeypatch.delenv("THINKCRAFT_DEVICE_TIMING", raising=False)
    assert device_timing_on() is False
    monkeypatch.setenv("THINKCRAFT_DEVICE_TIMING", "1")
    assert device_timing_on() is True
    before = {"decode_steps": 10.0, "dev_decode_s": 0.02, "dev_decode_n": 10.0}
    after = {"decode_steps": 30.0, "dev_decode_s": 0.08, "dev_decode_n": 30.0}
    d = decode_metrics_delta(before, after)
    assert d["engine/dev_decode_ms"] == pytest.approx(3.0) and d["engine/dev_decode_s"] == pytest.approx(0.06)
    assert not any(k.startswith("engine/dev_") for k in decode_metrics_delta({}, {"decode_steps": 1.0}))
