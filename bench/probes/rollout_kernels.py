"""Where do a profiled rollout's device kernels go: a packed prefill call's kernels and a decode iteration's, by name.

Reads the device timeline that `bench/llm_policy_craftax.py --profile-rollout STEP` writes (`<case>_kernels.tsv.gz`:
every kernel's start, length and name) and cuts it at each `sample_kernel` (the fused sampler opens every decode
iteration): a segment without a FlashAttention forward is one decode iteration; a segment with one holds an
iteration and the step boundary's packed prefill, whose kernels are the segment's less a median iteration's. The
text env's XLA kernels (names of XLA's fusions and copies) are left out of both. Why: the rollout's profile table
sums every phase together, and the prefill (~70 ms a call) and the decode iteration (~2.7 ms) are tuned apart.

    python bench/probes/rollout_kernels.py bench/results/logs/<case>_kernels.tsv.gz [--top 25] [--out FILE.json]

Prints, for each phase, the kernels by total device time (us a prefill call / us an iteration, launches a call);
`--out` writes them as JSON ({phase: [{name, us, launches}]}, with the counts of calls and iterations).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

ENV_KERNEL = re.compile(r"fusion|^input_|^loop_|^wrapped_|Memcpy|Memset|memcpy|memset")
"""XLA's kernel names (the text env's step) and the copies: neither phase's."""


def _name(raw: str) -> str:
    return re.sub(r"_?\d+$", "", raw.strip())[:90]


def load(path: Path) -> list[tuple[float, float, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        head = f.readline().rstrip("\n").split("\t")
        if head[:3] != ["start_us", "dur_us", "name"]:
            raise SystemExit(f"{path}: not a kernel timeline (header {head[:3]}, want start_us, dur_us, name)")
        rows = []
        for line in f:
            s, d, n = line.rstrip("\n").split("\t", 2)
            rows.append((float(s), float(d), n))
    rows.sort()
    return rows


def split(rows: list[tuple[float, float, str]]) -> tuple[list[Counter], list[Counter], list[Counter]]:
    """(decode iterations, prefill segments, their launch counts) as per-name device-time counters."""
    cuts = [i for i, r in enumerate(rows) if r[2].startswith("sample_kernel")]
    if len(cuts) < 3:
        raise SystemExit("fewer than three sample_kernel launches: not a profiled rollout of the fused decode")
    decode, prefill, prefill_n = [], [], []
    for a, b in zip(cuts, cuts[1:] + [len(rows)]):
        time, n = Counter(), Counter()
        has_flash = False
        for s, d, raw in rows[a:b]:
            if ENV_KERNEL.search(raw):
                continue
            k = _name(raw)
            time[k] += d
            n[k] += 1
            has_flash |= "flash_fwd" in raw
        if has_flash:
            prefill.append(time)
            prefill_n.append(n)
        else:
            decode.append((time, n))
    if not decode:
        raise SystemExit("no decode iteration without a prefill in the timeline")
    return decode, prefill, prefill_n


def summary(path: Path, top: int) -> dict:
    rows = load(path)
    decode, prefill, prefill_n = split(rows)
    names = {k for t, _ in decode for k in t}
    med_t = {k: statistics.median(t.get(k, 0.0) for t, _ in decode) for k in names}
    med_n = {k: statistics.median(n.get(k, 0) for _, n in decode) for k in names}
    iter_us = statistics.median(sum(t.values()) for t, _ in decode)
    out: dict = {"file": str(path), "decode_iterations": len(decode), "prefill_calls": len(prefill),
                 "decode_iteration_us": round(iter_us, 1)}
    out["decode"] = [{"name": k, "us": round(med_t[k], 2), "launches": med_n[k]}
                     for k in sorted(names, key=lambda k: -med_t[k])[:top]]
    if prefill:
        tot, cnt = Counter(), Counter()
        for t, n in zip(prefill, prefill_n):
            for k, v in t.items():
                tot[k] += v - med_t.get(k, 0.0)  # less the iteration the segment also holds
                cnt[k] += n[k] - med_n.get(k, 0)
        c = len(prefill)
        out["prefill_call_us"] = round(sum(tot.values()) / c, 1)
        out["prefill"] = [{"name": k, "us": round(v / c, 1), "launches": round(cnt[k] / c, 1)}
                          for k, v in tot.most_common(top)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("timeline", type=Path, help="a <case>_kernels.tsv.gz from --profile-rollout")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not a.timeline.exists():
        p.error(f"{a.timeline} does not exist")
    s = summary(a.timeline, a.top)
    if "prefill" in s:
        print(f"prefill: {s['prefill_calls']} calls, {s['prefill_call_us'] / 1e3:.1f} ms of kernels a call")
        for r in s["prefill"]:
            print(f"  {r['us']:9.1f} us {r['launches']:7.1f}x  {r['name']}")
    print(f"decode: {s['decode_iterations']} iterations, {s['decode_iteration_us'] / 1e3:.3f} ms of kernels each")
    for r in s["decode"]:
        print(f"  {r['us']:9.2f} us {r['launches']:7.1f}x  {r['name']}")
    if a.out:
        a.out.write_text(json.dumps(s, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
