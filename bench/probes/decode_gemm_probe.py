"""What do the llm-policy decode step's GEMMs cost at their own shapes, and would another width or layout of the
folded LoRA weight be cheaper? (issue 19: in the s64 H100 profile the down projection, [256 x 4864] x [4864 x 912]
with the adapter's A folded in, moved its 8.9 MB of weights in ~10 us - under 1 TB/s - and gate/up 17.5 MB in ~11.)

    python bench/probes/decode_gemm_probe.py                    # GPU: the Qwen2.5-0.5B shape, 256 rows, rank 16
    python bench/probes/decode_gemm_probe.py --rows 248 --rank 16 --out bench/results/decode_gemm_probe.json

For each projection group of a layer (qkv, o, gate/up, down) and each variant - the folded weight as the engine
builds it (`N = out + k * rank`, F.linear on a [N, K] weight), its N padded up to a multiple of 64 / 128 (zero
columns), the plain weight (N = out) alone, and the plain weight + the adapter's A as a second GEMM - the time of
one GEMM as a decode step meets it: 24 distinct weights (one a layer, so no layer's weights are in L2 from the
last iteration) replayed from one CUDA graph, the mean over many replays. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

# (group, in features K, out features, adapters folded into the group's weight) of the Qwen2.5-0.5B shape
GROUPS = (("qkv", 896, 1152, 3), ("o", 896, 896, 1), ("gate_up", 896, 9728, 2), ("down", 4864, 896, 1))


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def _time_us(fns: list, reps: int) -> float:
    """Mean us of one call of `fns` (each a closure launching one GEMM), all of them captured in one CUDA graph."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm-up (cuBLAS workspace, heuristics) outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * len(fns))


def _first_shape_cost(dev, dt, calls: int = 6) -> dict:  # noqa: ANN001
    """The host time of a GEMM whose row count cuBLAS has not met before, against one it has (the prefill's packed
    token count is new at nearly every call: in the s64 profile each prefill's first layer waited 4-5 ms on the host
    before each of its GEMMs, the other 23 layers not at all). Rows ~23k (a 256-env turn), each GEMM group's
    weight; the wall time of one call with the device drained before and after, first against second call."""
    import time

    import torch

    out: dict[str, float] = {}
    for name, k, n, adapters in GROUPS:
        w = torch.randn(n + adapters * 16, k, device=dev, dtype=dt) * 0.02
        first, again = [], []
        for j in range(calls):
            x = torch.randn(23_000 + 37 * j + hash(name) % 29, k, device=dev, dtype=dt)
            for sink in (first, again):
                torch.cuda.synchronize()
                t = time.perf_counter()
                torch.mm(x, w.t())
                t_host = time.perf_counter() - t  # the call's own host time (the kernel runs after it returns)
                torch.cuda.synchronize()
                sink.append(t_host * 1e6)
        out[f"{name}_first_host_us"] = round(sorted(first)[len(first) // 2], 1)
        out[f"{name}_again_host_us"] = round(sorted(again)[len(again) // 2], 1)
    return {"group": "first_shape_host_cost", "rows": "~23k, new each call", **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24, help="distinct weights a replay cycles through")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_gemm_probe.json"))
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("decode_gemm_probe: needs a CUDA GPU")
        return 2
    from common import card, today

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, k, out, adapters in GROUPS:
        x = torch.randn(a.rows, k, device=dev, dtype=dt)
        folded = out + adapters * a.rank
        widths = {"folded": folded, "folded_pad64": _pad(folded, 64), "folded_pad128": _pad(folded, 128),
                  "plain": out}
        res: dict[str, float] = {}
        for label, n in widths.items():
            ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(a.layers)]
            outs = [torch.empty(a.rows, n, device=dev, dtype=dt) for _ in range(a.layers)]
            res[label] = _time_us([lambda w=w, o=o: torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)], a.reps)
            if label == "plain":  # + the adapters' A as a GEMM of its own
                As = [torch.randn(adapters * a.rank, k, device=dev, dtype=dt) * 0.02 for _ in range(a.layers)]
                hs = [torch.empty(a.rows, adapters * a.rank, device=dev, dtype=dt) for _ in range(a.layers)]
                fns = []
                for w, o, A_, h in zip(ws, outs, As, hs):
                    fns += [lambda w=w, o=o: torch.mm(x, w.t(), out=o), lambda A_=A_, h=h: torch.mm(x, A_.t(), out=h)]
                res["plain_plus_A"] = _time_us(fns, a.reps) * 2  # two GEMMs a layer: their sum
            if label == "folded":  # the same weight stored [K, N] (x @ W instead of x @ W^T)
                wt = [w.t().contiguous() for w in ws]
                res["folded_kn"] = _time_us([lambda w=w, o=o: torch.mm(x, w, out=o) for w, o in zip(wt, outs)], a.reps)
                res["folded_linear"] = _time_us([lambda w=w: F.linear(x, w) for w in ws], a.reps)
            del ws, outs
        weight_mb = folded * k * 2 / 1e6
        row = {"group": name, "rows": a.rows, "k": k, "n_folded": folded, "weight_mb": round(weight_mb, 2),
               **{f"{v}_us": round(t, 2) for v, t in res.items()},
               "folded_tb_per_s": round(weight_mb / res["folded"], 2),  # MB / us
               "card": card(), "date": today()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append(_first_shape_cost(dev, dt))
    print(json.dumps(rows[-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
