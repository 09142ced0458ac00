"""The shared prefix's KV written again at each weight version by one CUDA-graph replay, not an eager forward.

Why: continuous batching keeps one shared prefix (a task's instructions) in the slot cache's prefix buffers, and
a new weight version makes it stale: the engine recomputes it before its next decode step (`Batcher._invalidate`),
standing still meanwhile. Eager, that is one HF forward of the prefix - ~1,400 torch calls for the
Qwen2.5-0.5B shape - plus a copy per layer into the buffers, each call giving up the interpreter lock and waiting
to take it back behind the learner's thread (which, in the async loop, has just published the version and starts
its next update at once). The dedicated two-GPU run stood still 0.07-0.16 s per update (2 x H200, 2026-11-29,
BENCHMARKS §10); the grouped weight copy took the copy phase's ~870 calls to 2, and this takes the switch's
~1,500 to a few: the forward and the buffers' copies are captured once per (prefix, buffers, parameters' addresses,
autocast dtype, adapters on/off) and replayed at every version. The weights are changed in place
(`weights.apply_state`, an optimizer's step), so a replay reads the new ones; derived copies that the forward
reads (`autocast_shadow`, `lora_fast`, `fused_proj`) are refreshed by the batcher before it replays, as before a
graphed decode step.

Trust, but check: a forward that decided something on the host at capture time (a cached value, a Python branch
on a tensor) would replay that decision silently. So the first `VERIFY` writes (the capture's and the next
version's, after the weights changed) are compared bit for bit with the eager forward; any difference, like any
capture or replay error, turns the graph off for good with one warning, and the eager path writes the prefix
(counted: `prefix_graph_failed`). Only on CUDA, without an SM partition (a partition's stream limits the SMs a
graph captured on another stream would not), for the slot cache's installed prefix; `THINKCRAFT_PREFIX_GRAPH=0`
turns it off (the A/B switch; on by default).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from thinkcraft.utils.errors import env_switch

log = logging.getLogger(__name__)

VERIFY = 2
"""Writes compared with the eager forward before the graph is trusted: the capture's, and the first replay after
a weight change (what a frozen host-side decision would get wrong)."""


def prefix_graph_on() -> bool:
    """THINKCRAFT_PREFIX_GRAPH: "1" (default) replays the shared prefix's forward at a weight version, "0" runs
    it eagerly (module doc)."""
    return env_switch("THINKCRAFT_PREFIX_GRAPH", default=True)


KV = list[tuple[torch.Tensor, torch.Tensor]]


class PrefixGraph:
    """One engine's prefix graph. `write(kv, prefix, key)` puts `prefix`'s per-layer K/V under the current weights
    into `kv`'s prefix buffers (`SlotKV.set_prefix`) by a replay, capturing first where `key` is new; False where it
    did not (off for good after a failure): the caller then writes them eagerly."""

    def __init__(self, forward: Callable[[torch.Tensor], KV], device: torch.device,
                 capture: Callable[..., tuple[Callable[[], Any], Any]] | None = None, gate: Any = None,
                 verify: int = VERIFY) -> None:
        """`forward(ids)` -> per-layer (k, v), (1, Hkv, P, d) each: the engine's uncached prefix forward
        (`_prefix_forward`); `capture(run, device)` -> (replay, out) (default: the decode graphs'
        `_graph_capture`), `gate` the process's `CaptureGate` (tests pass stand-ins for both on the CPU)."""
        if capture is None or gate is None:
            from thinkcraft.llm.hf.cache import CAPTURE_GATE, _graph_capture

            capture, gate = capture or _graph_capture, gate or CAPTURE_GATE
        self.forward, self.device, self.capture, self.gate = forward, device, capture, gate
        self.verify = verify
        self.key: tuple | None = None
        self.kv_ref: weakref.ref | None = None
        self.replay: Callable[[], Any] | None = None
        self.ids: torch.Tensor | None = None
        self.checked = 0  # writes compared with the eager forward so far (for the current graph)
        self.failed = False
        self.captures, self.capture_s, self.replays = 0, 0.0, 0

    def write(self, kv: Any, prefix: np.ndarray, key: tuple) -> bool:
        if self.failed:
            return False
        p = len(prefix)
        full = (tuple(int(t) for t in prefix), key)
        try:
            # the cache by identity (a weak reference: a replaced cache is freed, and one allocated at its old
            # addresses is still a new cache - its buffers' shapes may differ)
            if full != self.key or self.kv_ref is None or self.kv_ref() is not kv:
                self._capture(kv, prefix, full)
            else:
                with self.gate.shared():  # no replay while another engine captures (CaptureGate)
                    self.replay()  # type: ignore[misc]
                self.replays += 1
            kv.prefix_len = p
            if self.checked < self.verify:
                want = self.forward(self.ids)  # type: ignore[arg-type]
                same = all(torch.equal(kb[:, :, :p], k) and torch.equal(vb[:, :, :p], v)
                           for (k, v), kb, vb in zip(want, kv.prefix_keys, kv.prefix_values))
                if not same:  # the caller writes the eager KV (False below)
                    raise RuntimeError("its replay differs from the eager forward")
                self.checked += 1
            return True
        except Exception as e:  # noqa: BLE001 - any capture, replay or check failure: the eager forward, for good
            self.failed = True
            self.key = self.replay = self.ids = self.kv_ref = None
            log.warning("the shared prefix's graph is off (%s: %s); the prefix is recomputed eagerly at each weight "
                        "version", type(e).__name__, e)
            return False

    def _capture(self, kv: Any, prefix: np.ndarray, full: tuple) -> None:
        self.key = self.replay = None  # the old graph (and its memory) goes before the new one is made
        ids = torch.as_tensor(np.asarray(prefix, dtype=np.int64)[None]).to(self.device)
        t0 = time.perf_counter()
        with self.gate.exclusive():
            # the run writes the buffers itself: a replay is the whole switch (the warm-up runs write them too)
            replay, _ = self.capture(lambda: kv.set_prefix(self.forward(ids)) or kv.prefix_keys[0], self.device)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        self.key, self.replay, self.ids, self.checked = full, replay, ids, 0
        self.kv_ref = weakref.ref(kv)
        with self.gate.shared():
            replay()  # the capture itself computed nothing on a GPU: this write is the first
        self.replays += 1
        log.info("shared-prefix graph %d captured on %s (%d tokens): %.2f s", self.captures, self.device,
                 len(prefix), time.perf_counter() - t0)
