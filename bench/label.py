"""Labelling pipeline overhead: `thinkcraft label` (local engine) against the raw engine on the same items.

    .venv/bin/python bench/label.py            # GPU: Qwen3-4B-shaped model (random bf16 weights); CPU: bundled model
    .venv/bin/python bench/label.py --quick    # CPU smoke run (tiny random model, seconds)

Both sides use one already-loaded engine, the same items (synthetic Craftax-like compact states, ~60-90
tokens each, distinct), the same shared prefix, batch size and greedy sampling with a fixed answer
length (random weights rarely emit EOS; `--max-new-tokens` caps it either way):
  raw       `engine.generate(Batch(items, prefix), sampling)` over the batches, nothing else
  pipeline  `label(...)` end to end: read the Parquet input, render the template, key and de-duplicate,
            generate in the same batches, validate, journal + atomic Parquet shards, report
items/s = items / wall seconds of the whole call; tokens/s = generated tokens / wall seconds (raw side).
Goal: pipeline_items_per_s >= 0.8 x raw_items_per_s (overhead <= 20%). Each side runs `--repeats` times
after one warm-up batch, alternating, and the best run of each is kept.

On a shared, busy CPU the two sides' speeds swing with the load, so the record also has a direct
measurement that does not depend on it: inside the pipeline run, the seconds spent in the engine's
`generate` are timed, and `pipeline_own_s` = wall - generate seconds is what the pipeline adds
(`own_overhead_pct` = its share of the pipeline's wall time).

Writes bench/results/label.json (records: engine, items, raw_items_per_s, pipeline_items_per_s,
tokens_per_s, overhead_pct, batch_size, max_new_tokens, machine, date).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import card, print_table, today, write_records  # noqa: E402

PREFIX = (
    "You are an expert Craftax player. Read the observation and suggest the single best next action "
    "and the subgoal it serves. Positions are (row, col) offsets from you.\n"
)
THINGS = ["tree", "stone", "water", "coal", "iron", "cow", "zombie", "skeleton", "table", "furnace", "lava"]


def synthetic_states(n: int, seed: int = 0) -> list[str]:
    """Distinct compact-format-like observations (what `thinkcraft collect` writes), ~250-400 chars."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lines = [f"{rng.choice(['day', 'night', 'dusk'])}, facing {rng.choice(['north', 'south', 'east', 'west'])}: "
                 f"{rng.choice(THINGS)} (step {i})"]
        for thing in rng.sample(THINGS, rng.randint(3, 6)):
            pos = " ".join(f"({rng.randint(-4, 4):+d},{rng.randint(-5, 5):+d})" for _ in range(rng.randint(1, 3)))
            lines.append(f"{thing} {pos}")
        inv = ", ".join(f"{k} {rng.randint(1, 9)}" for k in rng.sample(["wood", "stone", "coal", "sapling"], 2))
        lines.append(f"inventory: {inv}")
        lines.append(f"health {rng.randint(1, 9)}, food {rng.randint(1, 9)}, drink {rng.randint(1, 9)}, "
                     f"energy {rng.randint(1, 9)}")
        out.append("\n".join(lines))
    return out


def make_engine(kind: str, device: str) -> tuple[Any, str]:
    import torch

    from thinkcraft.llm.hf import HFEngine

    if kind == "bundled":
        return HFEngine("default", device=device), "hf:smollm2-135m"
    from transformers import AutoModelForCausalLM

    from thinkcraft.llm.testing import bundled_tokenizer, qwen3_4b_config, tiny_llama

    if kind == "tiny":
        model, tok = tiny_llama()
        return HFEngine.from_model(model.to(device), tok), "hf:tiny-llama"
    tok = bundled_tokenizer()
    # the 4B shape incl. its 151,936-row embedding/LM head (decode timing depends on it); the bundled
    # tokenizer's ids all fall inside it
    cfg = qwen3_4b_config()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return HFEngine.from_model(model.eval().requires_grad_(False), tok), "hf:qwen3-4b-shape"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny random model, few items")
    ap.add_argument("--model", choices=["auto", "tiny", "bundled", "4b"], default="auto",
                    help="auto: 4b on GPU, bundled on CPU (tiny with --quick)")
    ap.add_argument("--items", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "label.json"))
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from thinkcraft.label.pipeline import LabelConfig, label
    from thinkcraft.llm.protocol import Batch, SamplingParams

    gpu = torch.cuda.is_available() and not args.quick
    device = "cuda" if gpu else "cpu"
    kind = args.model if args.model != "auto" else ("4b" if gpu else ("tiny" if args.quick else "bundled"))
    items_n = args.items or (1024 if gpu else (32 if args.quick else 128))
    batch_size = args.batch_size or (256 if gpu else (16 if args.quick else 32))
    new_tokens = args.max_new_tokens or (64 if gpu else (8 if args.quick else 16))

    engine, engine_name = make_engine(kind, device)
    texts = synthetic_states(items_n)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, logprobs=False, seed=0)
    work = Path(tempfile.mkdtemp(prefix="bench-label-"))
    inp = work / "items.parquet"
    pq.write_table(pa.table({"text": texts}), inp)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def raw() -> tuple[float, int]:
        sync()
        t0 = time.perf_counter()
        gen = 0
        for a in range(0, items_n, batch_size):
            comps = engine.generate(Batch(items=texts[a:a + batch_size], prefix=PREFIX), sampling)
            gen += sum(len(c.token_ids) for c in comps)
        sync()
        return time.perf_counter() - t0, gen

    class TimedEngine:
        """The same engine; counts the seconds spent in generate (what the pipeline does not add)."""

        def __init__(self) -> None:
            self.generate_s = 0.0

        def generate(self, batch: Any, sp: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            out = engine.generate(batch, sp)
            sync()
            self.generate_s += time.perf_counter() - t0
            return out

    def pipeline(run: int) -> tuple[float, dict, float]:
        out = work / f"out-{run}"
        cfg = LabelConfig(input=str(inp), out_dir=str(out), prefix=PREFIX, item="{text}", batch_size=batch_size,
                          max_new_tokens=new_tokens, temperature=0.0, shard_items=max(batch_size, 500))
        sync()
        t0 = time.perf_counter()
        timed = TimedEngine()
        rep = label(cfg, engine=timed, model_name=engine_name)
        sync()
        dt = time.perf_counter() - t0
        shutil.rmtree(out, ignore_errors=True)
        return dt, rep, dt - timed.generate_s

    engine.generate(Batch(items=texts[:batch_size], prefix=PREFIX), sampling)  # warm-up
    raw_s, pipe_s, own_s, gen_tokens = [], [], [], 0
    for r in range(args.repeats):
        dt, gen_tokens = raw()
        raw_s.append(dt)
        dt, rep, own = pipeline(r)
        assert rep["labelled"] == items_n, rep
        pipe_s.append(dt)
        own_s.append(own)
    shutil.rmtree(work, ignore_errors=True)
    raw_ips = items_n / min(raw_s)
    pipe_ips = items_n / min(pipe_s)
    rec = {
        "engine": engine_name, "items": items_n, "batch_size": batch_size, "max_new_tokens": new_tokens,
        "raw_items_per_s": round(raw_ips, 3), "pipeline_items_per_s": round(pipe_ips, 3),
        "tokens_per_s": round(gen_tokens / min(raw_s), 1),
        "overhead_pct": round(100.0 * (1.0 - pipe_ips / raw_ips), 2),
        "pipeline_own_s": round(min(own_s), 4),
        "own_overhead_pct": round(100.0 * min(own_s) / min(pipe_s), 3),
        "raw_runs_s": [round(x, 3) for x in raw_s], "pipeline_runs_s": [round(x, 3) for x in pipe_s],
        "machine": card(), "date": today(), "quick": args.quick,
    }
    print_table([rec], ["engine", "items", "batch_size", "max_new_tokens", "raw_items_per_s",
                        "pipeline_items_per_s", "tokens_per_s", "overhead_pct", "pipeline_own_s",
                        "own_overhead_pct", "machine"])
    path = write_records(args.out, [rec], merge_keys=("engine", "machine", "items", "batch_size", "quick"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
