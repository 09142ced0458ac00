"""llm/hf/cache.CaptureGate: engines on several GPUs step from their own threads; a decode graph's capture waits for
the steps under way and holds new ones back (the 2-GPU async stall of 2026-11-27). Pure threading: CPU."""

import threading
import time

from thinkcraft.llm.hf.cache import CaptureGate


def test_capture_gate_waits_for_running_steps_and_holds_new_ones_back():
    """llm/hf/cache.CaptureGate: a capture starts only when no decode step is under way, and no step starts
    until it ends - even while steps keep arriving (writers first)."""
    gate = CaptureGate()
    events: list[str] = []
    lock = threading.Lock()

    def note(x: str) -> None:
        with lock:
            events.append(x)

    in_step, release_step = threading.Event(), threading.Event()

    def long_step() -> None:
        with gate.shared():
            note("step0 start")
            in_step.set()
            release_step.wait(5)
            note("step0 end")

    def capture() -> None:
        with gate.exclusive():
            note("capture start")
            time.sleep(0.2)
            note("capture end")

    def later_step() -> None:
        with gate.shared():
            note("step1")

    s0 = threading.Thread(target=long_step)
    s0.start()
    assert in_step.wait(5)
    c = threading.Thread(target=capture)
    c.start()
    time.sleep(0.1)
    assert events == ["step0 start"]  # the capture waits for the running step
    s1 = threading.Thread(target=later_step)
    s1.start()  # arrives while the capture waits: held back (writers first)
    time.sleep(0.1)
    assert events == ["step0 start"]
    release_step.set()
    for t in (s0, c, s1):
        t.join(5)
    assert events == ["step0 start", "step0 end", "capture start", "capture end", "step1"]
    assert gate.waited_s >= 0.15  # step1 waited for the capture


def test_capture_gate_lets_steps_run_together_and_captures_one_at_a_time():
    gate = CaptureGate()
    with gate.shared(), gate.shared():  # two engines' steps at once (as the async pools' slot threads)
        pass
    inside = []
    overlap = []

    def capture(k: int) -> None:
        with gate.exclusive():
            inside.append(k)
            overlap.append(len(inside))
            time.sleep(0.05)
            inside.remove(k)

    ts = [threading.Thread(target=capture, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert overlap == [1, 1, 1, 1] and gate.waited_s == 0.0
