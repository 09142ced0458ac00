"""Opt-in device-side timing of the batcher's phases (THINKCRAFT_DEVICE_TIMING=1): each packed prefill and each
decode iteration bracketed by two timed CUDA events on the engine's stream, read back once they have completed.

Why (issue 19): the Craftax rollout's decode step takes ~3.1 ms of wall time a step while the same step in the
probe (`bench/probes/decode_step_probe.py`, no env, no turns) takes ~2.05 ms, and the profiler cannot tell which
it is - a slower step on the device or the device waiting between steps: it lengthens every graph launch itself
(CUPTI records each of a graph's ~400 kernels). Two events per phase cost a few microseconds of host time and
nothing on the device, so the rollout can be measured as it runs.

Measured (H200, 2026-12-03, BENCHMARKS §7b "Where a rollout's time goes"): the rollout's decode loop is bound by the
device (2.6 ms an iteration, 0.09 ms idle between iterations; the profiler's gaps were its own), and a third of the
rollout is the device idle at the turns' boundaries (~90 ms a turn: env, prompts, submit).

What it counts, in seconds, into the batcher's counters (summed, with a count each; `rollout.decode_metrics_delta`
turns them into means per phase or gap):
    dev_decode_s, dev_decode_n    the device time of the decode iterations (from the first kernel's start to the
                                  last one's end; a launch that reached an idle device includes its latency)
    dev_prefill_s, dev_prefill_n  the same for the packed prefills (their tokens' forward, logits, rows' state)
    dev_gap_<a>_<b>_s, _n         the device's idle time between a phase of kind a ending and the next of kind b
                                  starting: decode_decode is the decode loop's bubbles (the host late with the next
                                  launch), decode_prefill and prefill_prefill the host's work between a turn's
                                  decode and its prefills (env, prompts, submit), prefill_decode the prefill's tail
Everything else the device ran between two phases (a weight update's copies, the shared prefix's forward, an env's
kernels on the same GPU) counts as gap: the counters say where the device did not run this engine's phases.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from thinkcraft.utils.errors import env_switch


def device_timing_on() -> bool:
    """THINKCRAFT_DEVICE_TIMING (off: a diagnostic)."""
    return env_switch("THINKCRAFT_DEVICE_TIMING", default=False)


class DeviceTiming:
    """Timed events around the phases of one engine's device stream (see the module docstring). `start(kind)`
    before a phase's launches and `end()` after them, in order (phases do not nest); `harvest(counters)` adds
    every completed phase, oldest first, without waiting for any."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._open: tuple[str, Any] | None = None
        self._spans: deque[tuple[str, Any, Any]] = deque()
        self._last: tuple[str, Any] | None = None  # the newest harvested phase's (kind, end event)

    def _event(self) -> Any:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self, kind: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"device timing: phase {self._open[0]!r} still open at the start of {kind!r}")
        self._open = (kind, self._event())

    def end(self) -> None:
        if self._open is None:
            raise RuntimeError("device timing: end() without start()")
        kind, begin = self._open
        self._open = None
        self._spans.append((kind, begin, self._event()))

    def harvest(self, counters: dict[str, float]) -> None:
        while self._spans and self._spans[0][2].query():
            kind, begin, end = self._spans.popleft()
            _add(counters, f"dev_{kind}", begin.elapsed_time(end) / 1000.0)
            if self._last is not None:
                prev, prev_end = self._last
                _add(counters, f"dev_gap_{prev}_{kind}", max(prev_end.elapsed_time(begin), 0.0) / 1000.0)
            self._last = (kind, end)

    def forget(self) -> None:
        """Drop what has not been read (a cache rebuilt, a failure): the next phase starts a new chain."""
        self._open, self._last = None, None
        self._spans.clear()


def _add(counters: dict[str, float], key: str, seconds: float) -> None:
    counters[key + "_s"] = counters.get(key + "_s", 0.0) + seconds
    counters[key + "_n"] = counters.get(key + "_n", 0.0) + 1.0


def per_call_ms(d: dict[str, float]) -> dict[str, float]:
    """`engine/dev_*_ms` means (milliseconds per phase or gap) of a counters' delta `d` that holds `dev_*_s` and
    `dev_*_n` pairs (none without THINKCRAFT_DEVICE_TIMING), and `engine/dev_*_s` totals."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if k.startswith("dev_") and k.endswith("_s"):
            base = k[:-2]
            n = d.get(base + "_n", 0.0)
            out[f"engine/{base}_s"] = v
            out[f"engine/{base}_ms"] = 1000.0 * v / n if n else 0.0
    return out
