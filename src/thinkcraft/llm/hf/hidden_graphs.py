"""Hidden states (last-token reads after a shared prefix) replayed from CUDA graphs, one per padded shape.

Why: a hidden-state forward's host work - the compiled layers' guard checks and launches, 36 layers for the
Qwen3-4B shape - does not shrink with its batch, while its GPU work does. One engine on 136 texts is bound by the
GPU (~190 ms on an H100), but the same texts split over three in-process engines took *longer* (223 ms; 4 x
H100, 2026-11-28, BENCHMARKS §8). The reading these graphs test: three forwards' host work, one after another
under the interpreter lock, outweighs a third of the GPU work each (three Ray actors, each with its own
interpreter, took 83 ms - more than a third of 190 ms too). A replayed graph costs almost no host time, so
shards on several GPUs (threads or actors) could run side by side.

How: the batch's rows are padded to a bucket (rows to a multiple of `ROW_BUCKET`, tokens to a multiple of
`TOKEN_BUCKET`); padded rows read one token, and right padding is exact for every real token (causal attention
keeps the pads after it out of view), so the first B rows of a padded replay are the unpadded rows' states. A
graph is captured per (rows, tokens, layer, prefix) the first time the shape is met (counted and timed:
`captures`, `capture_s`, `replays`; each capture logged), on the engine's device, holding `CAPTURE_GATE` alone
like the decode graphs. The graph reads the parameters and the prefix's KV by address: it keeps the KV alive,
weights changed in place are read as they are (a changed prefix KV is a new key: a new graph), and a model
whose parameters are *replaced* by new tensors must not use it (feature engines are frozen). At most
`MAX_GRAPHS` graphs live (least recently used dropped).

Opt-in (THINKCRAFT_HIDDEN_GRAPHS=1, `hidden_graphs_on`) until a GPU run measures it (bench/scale.py
--hidden-graphs); only for a frozen model on CUDA without an SM partition (a partition's stream limits the SMs
a graph captured on another stream would not), pooling "last". Anything else, or a capture that fails (one
warning), takes the compiled path as before.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from thinkcraft.utils.errors import env_switch

log = logging.getLogger(__name__)

ROW_BUCKET = 8
TOKEN_BUCKET = 32
MAX_GRAPHS = 16


def hidden_graphs_on() -> bool:
    """THINKCRAFT_HIDDEN_GRAPHS: "1" replays hidden-state forwards from CUDA graphs (module doc), "0" or unset
    does not (the default until a GPU run shows it faster)."""
    return env_switch("THINKCRAFT_HIDDEN_GRAPHS")


def bucket(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


class HiddenGraphs:
    """The graphs of one engine. `run(items, p, kv, idx)` -> (B, H) float32 states of the rows' last tokens, or
    None when this call cannot be graphed (the caller then runs its compiled path)."""

    def __init__(self, forward: Callable[..., torch.Tensor], device: torch.device, pad_id: int,
                 capture: Callable[..., tuple[Callable[[], Any], torch.Tensor]] | None = None,
                 gate: Any = None) -> None:
        """`forward(ids, start, idx, kv, begin, end, pooling)` is the engine's `_layers_pooled`; `capture(run,
        device)` -> (replay, out) (default: the decode graphs' `_graph_capture`), `gate` the process's
        `CaptureGate` (tests pass stand-ins for both on the CPU)."""
        if capture is None or gate is None:
            from thinkcraft.llm.hf.cache import CAPTURE_GATE, _graph_capture

            capture, gate = capture or _graph_capture, gate or CAPTURE_GATE
        self.forward, self.device, self.pad_id = forward, device, pad_id
        self.capture, self.gate = capture, gate
        self.graphs: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
        # one memory pool for all of this engine's graphs (one replays at a time, its output copied at once):
        # the largest graph's activations, not the sum of them
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.captures, self.capture_s, self.replays = 0, 0.0, 0
        self.failed = False

    def run(self, items: list[list[int]], p: int, kv: list, idx: int) -> torch.Tensor | None:
        if self.failed or not items:
            return None
        b, s = len(items), max(len(it) for it in items)
        bb, sb = bucket(b, ROW_BUCKET), bucket(s, TOKEN_BUCKET)
        ids = np.full((bb, sb), self.pad_id, dtype=np.int64)
        last = np.zeros(bb, dtype=np.int64)  # padded rows read their first token
        for i, it in enumerate(items):
            ids[i, : len(it)] = it
            last[i] = len(it) - 1
        key = (bb, sb, idx, p, id(kv))
        try:
            g = self.graphs.get(key)
            if g is None:
                g = self._capture(key, bb, sb, p, kv, idx)
            self.graphs.move_to_end(key)
            with self.gate.shared():
                g["ids"].copy_(torch.from_numpy(ids), non_blocking=True)
                g["end"].copy_(torch.from_numpy(last + 1), non_blocking=True)
                g["replay"]()
            self.replays += 1
            return g["out"][:b].clone()  # the next replay overwrites the graph's output
        except Exception as e:  # noqa: BLE001 - any capture or replay failure: the compiled path, for good
            self.failed = True
            self.graphs.clear()
            log.warning("hidden-state graphs unavailable (%s: %s); running the compiled layers", type(e).__name__, e)
            return None

    def _capture(self, key: tuple, bb: int, sb: int, p: int, kv: list, idx: int) -> dict[str, Any]:
        dev = self.device
        ids = torch.full((bb, sb), self.pad_id, dtype=torch.long, device=dev)
        end = torch.ones(bb, dtype=torch.long, device=dev)
        start = torch.tensor([p], device=dev)
        begin = torch.zeros(bb, dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        with self.gate.exclusive():
            replay, out = self.capture(lambda: self.forward(ids, start, idx, kv, begin, end, "last"), dev, self.pool)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        log.info("hidden-state graph %d captured on %s (%d rows x %d tokens, layer %d): %.1f s", self.captures, dev,
                 bb, sb, idx, time.perf_counter() - t0)
        # the graph reads the prefix KV by address: it keeps the tensors alive with it
        g = {"replay": replay, "ids": ids, "end": end, "start": start, "begin": begin, "out": out, "kv": kv}
        self.graphs[key] = g
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return g
