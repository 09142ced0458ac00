"""What does a decode step's sampling cost, torch's sampler against the one-pass kernel (llm/hf/fused_sampler.py)?

The question (2026-11-29, eighth session): the arith loops' decode step is device-bound (~1.8 ms, the host waiting
1.0-1.4 ms of it) and torch's sampler reads every slot's float32 logits ~10 times a step (divide, softmax,
exponential fill, divide, argmax, the greedy argmax, the log-probs' logsumexp); the kernel reads them once. This
times both alone, as the engine calls them: sampled rows (one in four greedy), the behaviour log-probs wanted,
for each slot count at Qwen's vocabulary, each call replayed from a CUDA graph (the engine's fused decode graph
holds them) and timed by CUDA events over `--repeats` replays after a warm-up.

    python bench/probes/sampler_probe.py                       # 64, 128, 256 slots x 151,936 (a GPU)
    python bench/probes/sampler_probe.py --quick               # CPU: torch's sampler only, small shapes

Rows: {slots, vocab, torch_ms, fused_ms (None where the kernel does not serve), speedup, variant, card, date} in
bench/results/sampler_probe.json (`--out`).
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

COLS = ["slots", "vocab", "torch_ms", "fused_ms", "speedup", "variant"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--vocab", type=int, default=151936, help="Qwen2.5 / Qwen3's vocabulary by default")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="CPU plumbing: 8 slots x 4,096, torch's sampler only")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampler_probe.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.slots, a.vocab, a.repeats = [8], 4096, 5
    if any(s <= 0 for s in a.slots) or a.vocab <= 0 or a.repeats <= 0:
        p.error("--slots, --vocab and --repeats must be > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    import torch

    from thinkcraft.llm.hf import fused_sampler as FS
    from thinkcraft.llm.hf.rows import sample_rows, token_logprobs

    cuda = torch.cuda.is_available() and not a.quick
    dev = torch.device("cuda" if cuda else "cpu")
    rows = []
    for s in a.slots:
        g = torch.Generator(device="cpu").manual_seed(s)
        logits = (torch.randn(s, a.vocab, generator=g) * 3).to(dev)
        temp = torch.ones(s, device=dev)
        temp[::4] = 0.0
        top_p = torch.ones(s, device=dev)
        seed = torch.zeros(1, dtype=torch.long, device=dev)

        def torch_path() -> Any:  # what the engine ran before: the sample, then the log-probs of it
            tok = sample_rows(logits, temp, top_p, True, False, None)
            return torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).squeeze(1)

        def fused_path() -> Any:
            tok, lse = FS.sample_and_lse(logits, temp, seed)
            return token_logprobs(logits, tok, lse)

        t_torch = replay_ms(torch_path, a.repeats, cuda)
        t_fused = replay_ms(fused_path, a.repeats, cuda) if cuda and FS.fused_sampler_serves(logits) else None
        rows.append({"slots": s, "vocab": a.vocab, "torch_ms": round(t_torch, 4),
                     "fused_ms": None if t_fused is None else round(t_fused, 4),
                     "speedup": None if t_fused is None else round(t_torch / t_fused, 2),
                     # the kernel's noise that passed the device's check (fused_sampler.VARIANTS), or None
                     "variant": FS._CHECKS.known(logits.device) or None,
                     "card": card(), "date": today()})
        print_table(rows[-1:], COLS)
    write_records(a.out, rows, merge_keys=("slots", "vocab", "card"))
    print_table(rows, COLS)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
