"""What does a LoRA MLP's gate/up stage cost with its low-rank add in the SiLU kernel (llm/hf/fused_mlp.py
`lora_silu_mul`) against `addmm_`'s own pass then the plain SiLU kernel (THINKCRAFT_FUSED_MLP_LORA=0)?

The question (2026-12-07, third session): in the Craftax rollout's packed prefill (~23k tokens a call, the
Qwen2.5-0.5B shape, LoRA rank 16 on every linear) the gate/up group's low-rank add is a cuBLAS `addmm_` with
`beta = 1` over the whole `[gate | up]` output - a read and a write of 23k x 9,728 bf16 (~0.9 GB) a layer, ~9 ms of
a ~76 ms call in the 2026-12-03 profile (H200, `s57_craftax23_rollout_profile_*`, the `badd` GEMMs). The kernel
adds it on its way through the same tile. This times, at each row count, the MLP's stage from the fused GEMM's
output to the SiLU product, both ways, each replayed from a CUDA graph and timed by CUDA events; and the gate/up
GEMM alone for scale.

    python bench/probes/mlp_lora_probe.py                 # 248 and 23,040 rows (a GPU)
    python bench/probes/mlp_lora_probe.py --tiles         # and the kernel's tilings swept at each row count

Rows: {rows, n, rank, gemm_ms, addmm_silu_ms, fused_ms, saved_ms, speedup, card, date} in
bench/results/mlp_lora_probe.json (`--out`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))
from common import card, print_table, replay_ms, today, write_records  # noqa: E402

COLS = ["rows", "n", "rank", "gemm_ms", "addmm_silu_ms", "fused_ms", "saved_ms", "speedup"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[248, 23040])
    p.add_argument("--hidden", type=int, default=896, help="the MLP's input width (Qwen2.5-0.5B's)")
    p.add_argument("--n", type=int, default=4864, help="the MLP's width (gate and up: n columns each)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of each of gate and up")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--tiles", action="store_true",
                   help="also sweep the kernel's tile (rows 16-128 x columns 64-256) and warps (4, 8): rows tile_*")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mlp_lora_probe.json"))
    a = p.parse_args(argv)
    if min(a.rows + [a.hidden, a.n, a.rank, a.repeats]) <= 0:
        p.error("--rows, --hidden, --n, --rank and --repeats must be > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    import torch

    from thinkcraft.llm.hf import fused_mlp

    if not torch.cuda.is_available():
        print("needs a CUDA device (the kernels are Triton's; the CPU runs them only under its interpreter, "
              "tests/test_fused_mlp.py)")
        return 2
    dev, bf = torch.device("cuda"), torch.bfloat16
    if not fused_mlp.lora_serves(dev, bf):
        print("the LoRA kernel does not serve on this device (its first-use check failed, or the switch is off)")
        return 1
    n, r = a.n, 2 * a.rank
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (0.02 * torch.randn(2 * n + r, a.hidden, generator=g)).to(dev, bf)  # [W_gate; W_up; A_gate; A_up]
    bt = torch.zeros(r, 2 * n)
    bt[: a.rank, :n] = 0.02 * torch.randn(a.rank, n, generator=g)
    bt[a.rank:, n:] = 0.02 * torch.randn(a.rank, n, generator=g)
    bt = bt.to(dev, bf)
    rows = []
    for m in a.rows:
        x = torch.randn(m, a.hidden, generator=g).to(dev, bf)
        y = x @ w.t()
        work = y.clone()

        def gemm() -> Any:
            return torch.mm(x, w.t())

        def old() -> Any:  # Group.compute's in-place add, then the plain kernel (THINKCRAFT_FUSED_MLP_LORA=0); each
            # replay adds once more into the same buffer (what is timed, not the values)
            base = work[:, :2 * n]
            base.addmm_(work[:, 2 * n:], bt)
            return fused_mlp.silu_mul(work, n)

        def new() -> Any:
            return fused_mlp.lora_silu_mul(y, n, bt)

        t_gemm = replay_ms(gemm, a.repeats, True)
        t_old = replay_ms(old, a.repeats, True)
        t_new = replay_ms(new, a.repeats, True)
        rows.append({"rows": m, "n": n, "rank": a.rank, "hidden": a.hidden, "gemm_ms": round(t_gemm, 4),
                     "addmm_silu_ms": round(t_old, 4), "fused_ms": round(t_new, 4),
                     "saved_ms": round(t_old - t_new, 4), "speedup": round(t_old / t_new, 2),
                     "card": card(), "date": today()})
        print_table(rows[-1:], COLS)
        if a.tiles:
            sweep = {}
            for bm in (16, 32, 64, 128):
                for bn in (64, 128, 256):
                    for warps in (4, 8):  # (not `w`: the weight above, which the next row count's GEMM reads)
                        sweep[f"{bm}x{bn}w{warps}"] = round(replay_ms(
                            lambda: fused_mlp.lora_silu_mul(y, n, bt, tiles=(bm, bn), num_warps=warps), a.repeats,
                            True), 4)
            best = min(sweep, key=sweep.get)
            rows[-1].update({"tile_default": "{}x{}w{}".format(*[v or 4 for v in fused_mlp.lora_tiles(m)]), "tile_best": best,
                             "tile_best_ms": sweep[best], "tile_ms": sweep})
            print(f"  tiles at {m} rows: best {best} {sweep[best]} ms (default {rows[-1]['tile_default']}: "
                  f"{t_new} ms); " + ", ".join(f"{k} {v}" for k, v in sorted(sweep.items(), key=lambda kv: kv[1])[:6]))
    write_records(a.out, rows, merge_keys=("rows", "n", "rank", "hidden", "card"))
    print_table(rows, COLS)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
