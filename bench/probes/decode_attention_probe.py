"""What does a decode step's attention cost, FlashAttention's varlen calls against the split-KV kernels
(llm/hf/split_decode.py), by the number of rows?

The question (2026-11-30): the 2-GPU async arith run steps at ~80 rows in 1.8-1.95 ms and at ~60 rows in ~1.5 ms;
FlashAttention gives each (row, KV head) one thread block, so at 2 KV heads the blocks pass an H200's 132 SMs at 66
rows (a second wave). This times one decode step's attention over every layer as the engine runs it - each layer's
own slot cache (no layer's keys left in L2 for the next), the row's own columns plus a shared prefix, replayed from
a CUDA graph and timed by CUDA events:

- `flash_ms`: `attention.slot_decode_attention` + `attention.prefix_decode_attention` + their merge (the path the
  engine ran before, `THINKCRAFT_SPLIT_DECODE=0`);
- `split_ms`: `split_decode.split_decode_attention` (own columns and the prefix in one launch, then the combine).

    python bench/probes/decode_attention_probe.py                   # Qwen2.5-0.5B's shape: 24 layers, 2 x 7 heads
    python bench/probes/decode_attention_probe.py --rows 256 --width 2049 --mean-keys 1000   # issue 19's shape
    python bench/probes/decode_attention_probe.py --chunks 32 64 128 256   # the split kernel's keys per program
    python bench/probes/decode_attention_probe.py --quick           # CPU: plumbing only (no kernel times)

Rows: {rows, width, mean_keys, prefix, layers, kv_heads, group, head_dim, chunk, flash_ms, split_ms, speedup, card,
date}, one per chunk size,
in bench/results/decode_attention_probe.json (`--out`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))
from common import card, print_table, replay_ms, today, write_records  # noqa: E402

COLS = ["rows", "width", "mean_keys", "prefix", "chunk", "prefix_rows", "tile", "flash_ms", "split_ms", "speedup"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[43, 64, 80, 128, 256])
    p.add_argument("--width", type=int, default=1281, help="slot columns (the arith runs' cache: 1,280 + scratch)")
    p.add_argument("--mean-keys", type=int, default=560, help="mean own columns a row reads (uniform 1..2x-1)")
    p.add_argument("--prefix", type=int, default=128, help="the shared prefix's columns (every row reads it)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--group", type=int, default=7, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunks", type=int, nargs="+", default=None,
                   help="keys per program of the split kernel (default: split_decode.CHUNK, the engine's)")
    p.add_argument("--prefix-rows", type=int, nargs="+", default=None,
                   help="rows a shared-prefix program of the split kernel serves (THINKCRAFT_SPLIT_PREFIX_ROWS; 0: one "
                        "row a program, the code before 2026-12-01; default: split_decode.PREFIX_ROWS)")
    p.add_argument("--tiles", nargs="+", default=None, metavar="BLOCK_N:WARPS:STAGES",
                   help="the split kernels' tilings to time (keys per tl.dot, warps, pipelining stages or - for "
                        "Triton's default), e.g. 64:4:- 128:4:2 (default: split_decode's own)")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="CPU plumbing: 4 rows, 2 layers, no kernel timed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_attention_probe.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.width, a.mean_keys, a.prefix, a.layers, a.repeats = [4], 64, 20, 8, 2, 3
    for t in a.tiles or []:
        parts = t.split(":")
        if len(parts) != 3 or not all(x.isdigit() for x in parts[:2]) or not (parts[2] == "-" or parts[2].isdigit()):
            p.error(f"--tiles takes BLOCK_N:WARPS:STAGES (STAGES a number or -), not {t!r}")
    if a.chunks is not None and min(a.chunks) <= 0:
        p.error("--chunks must be > 0")
    if min(a.rows + [a.width, a.mean_keys, a.layers, a.kv_heads, a.group, a.head_dim, a.repeats]) <= 0 or a.prefix < 0:
        p.error("every size must be > 0 (--prefix >= 0)")
    if 2 * a.mean_keys - 1 > a.width:
        p.error(f"--mean-keys {a.mean_keys} needs a --width of at least {2 * a.mean_keys - 1}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    import torch

    from thinkcraft.llm import attention as A
    from thinkcraft.llm import compat
    from thinkcraft.llm.hf import split_decode as SD

    cuda = torch.cuda.is_available() and not a.quick
    if not cuda and not a.quick:  # both paths are CUDA kernels: a CPU run would time nothing
        print("decode_attention_probe: the two attentions are CUDA kernels and no GPU is visible; --quick checks "
              "the plumbing on the CPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    hkv, g, d = a.kv_heads, a.group, a.head_dim
    scale = d ** -0.5
    split_on = cuda and SD.serves(dev, dt, d, g)
    chunks = a.chunks or [SD.CHUNK]
    own_tile = f"{SD.BLOCK_N}:{SD.NUM_WARPS}:{'-' if SD.NUM_STAGES is None else SD.NUM_STAGES}"
    settings = [(c, r, t) for c in chunks for r in (a.prefix_rows or [SD.prefix_rows()])
                for t in (a.tiles or [own_tile])]
    rows = []
    for s in a.rows:
        gen = torch.Generator(device="cpu").manual_seed(s)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=dev, dtype=dt)

        q = rnd(s, hkv * g, 1, d)
        caches = [(rnd(s, hkv, a.width, d), rnd(s, hkv, a.width, d)) for _ in range(a.layers)]
        pcap = max(a.prefix, 1)
        prefixes = [(rnd(1, hkv, pcap, d), rnd(1, hkv, pcap, d)) for _ in range(a.layers)]
        key_len = torch.randint(1, 2 * a.mean_keys, (s,), generator=gen).to(device=dev, dtype=torch.int32)
        prefix_n = torch.full((s,), a.prefix, dtype=torch.int32, device=dev)
        meta = A.flash_decode_offsets(s, hkv, g, a.width, pcap, dev)
        slot_meta = (meta[0], meta[1], A.keys_per_sequence(key_len, hkv))
        prefix_meta = (meta[2], meta[3], torch.full((hkv,), pcap, dtype=torch.int32, device=dev))
        reads = prefix_n > 0

        def flash_path() -> Any:  # what the engine's decode ran per layer before (slots.py `_own_columns` + prefix)
            out = None
            for (kc, vc), (pk, pv) in zip(caches, prefixes):
                o, lse = A.slot_decode_attention(q, kc, vc, key_len, a.width, scale, compat.flash_decode, slot_meta)
                if a.prefix:
                    o_p, lse_p = A.prefix_decode_attention(q, pk, pv, scale, compat.flash_decode, prefix_meta)
                    o = A.merge_attention(o_p, torch.where(reads[:, None], lse_p, A.NO_KEYS_LSE)[..., None], o,
                                          lse[..., None])
                out = o
            return out

        def split_path(chunk: int = SD.CHUNK) -> Any:
            out = None
            for (kc, vc), (pk, pv) in zip(caches, prefixes):
                out = SD.split_decode_attention(q, kc, vc, key_len, pk if a.prefix else None, pv if a.prefix else None,
                                                prefix_n if a.prefix else None, scale, chunk)
            return out

        t_flash = replay_ms(flash_path, a.repeats, cuda) if cuda else None
        for chunk, prefix_rows, tile in settings:
            os.environ["THINKCRAFT_SPLIT_PREFIX_ROWS"] = str(prefix_rows)  # read when the kernels launch (captured)
            bn, warps, stages = tile.split(":")
            SD.BLOCK_N, SD.NUM_WARPS, SD.NUM_STAGES = int(bn), int(warps), None if stages == "-" else int(stages)
            t_split = replay_ms(functools.partial(split_path, chunk), a.repeats, cuda) if split_on else None
            if t_flash is not None and t_split is not None:  # the same attention, before the times mean anything
                err = float((flash_path().float() - split_path(chunk).float()).abs().max())
                assert err < 3e-2, f"the two paths differ by {err:.3g} (chunk {chunk}, prefix rows {prefix_rows})"
            rows.append({"rows": s, "width": a.width, "mean_keys": a.mean_keys, "prefix": a.prefix, "layers": a.layers,
                         "kv_heads": hkv, "group": g, "head_dim": d, "chunk": chunk, "prefix_rows": prefix_rows,
                         "tile": tile,
                         "flash_ms": None if t_flash is None else round(t_flash, 4),
                         "split_ms": None if t_split is None else round(t_split, 4),
                         "speedup": None if t_flash is None or t_split is None else round(t_flash / t_split, 2),
                         "card": card(), "date": today()})
        print_table(rows[-len(settings):], COLS)
        del caches, prefixes
    write_records(a.out, rows, merge_keys=("rows", "width", "mean_keys", "prefix", "layers", "kv_heads", "group",
                                           "head_dim", "chunk", "prefix_rows", "tile", "card"))
    print_table(rows, COLS)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
