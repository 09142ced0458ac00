"""Labelling benchmarks: structured (constrained) decoding, the pipeline's overhead, CPU threads under load.

    python bench/label.py --mode structured  # constrained vs unconstrained decoding (issue 22), see below
    python bench/label.py                    # --mode overhead (default): `thinkcraft label` vs the raw engine
    python bench/label.py --mode busy     # CPU: torch threads beside a busy-loop process (issue 22, item 6)
    python bench/label.py --quick         # CPU smoke run of the chosen mode (tiny random model, seconds)

--mode structured (issue 22). GPU: a Qwen3-4B-shaped model (random bf16 weights, bundled tokenizer),
1,024 synthetic Craftax states, batch 256, greedy, `--fields action:string` as the schema, prompted through
the chat template with the shared prefix apart; the same batches decoded with and without the JSON
constraint (llm/constrained.py: one batched xgrammar mask fill + one masking kernel per step). Random
weights rarely close a JSON string, so both sides mostly run the full --max-new-tokens (the per-step cost is
what is compared; `decode_ms_per_step` says it directly). Goal: constrained items/s >= 0.9 x unconstrained
(overhead <= 10%). CPU: the bundled model through `label()` exactly as `thinkcraft label --engine hf:default
--fields action:string --max-new-tokens 32` runs it (chat template; constrained, and not, for reference):
first-pass valid fraction (goal >= 0.95) and items/s.
Rows {engine, constrained, device, items, valid_frac, items_per_s, card, date, ...} -> bench/results/label.json.

--mode overhead: both sides use one already-loaded engine, the same items (synthetic Craftax-like compact
states, ~60-90 tokens each, distinct), the same shared prefix, batch size and greedy sampling with a fixed
answer length (random weights rarely emit EOS; `--max-new-tokens` caps it either way):
  raw       `engine.generate(Batch(items, prefix), sampling)` over the batches, nothing else
  pipeline  `label(...)` end to end (raw prompt format, free text): read the Parquet input, render the
            template, key and de-duplicate, generate in the same batches, validate, journal + atomic Parquet
            shards, report
items/s = items / wall seconds of the whole call; tokens/s = generated tokens / wall seconds (raw side).
Goal: pipeline_items_per_s >= 0.8 x raw_items_per_s (overhead <= 20%). Each side runs `--repeats` times
after one warm-up batch, alternating, and the best run of each is kept. On a shared, busy CPU the two
sides' speeds swing with the load, so the record also has `pipeline_own_s` = wall - seconds inside the
engine's `generate` (what the pipeline adds) and `own_overhead_pct` = its share of the pipeline's wall time.
Records: engine, items, raw_items_per_s, pipeline_items_per_s, tokens_per_s, overhead_pct, batch_size,
max_new_tokens, machine, date.

--mode busy: the bundled model labels the same items with torch's default threads (one per usable core)
and with `--threads 0` (auto: usable cores minus busy ones, label/threads.py), first on an idle machine,
then beside one busy-loop process; rows {threads, busy_procs, items_per_s, ...} -> bench/results/label_threads.json.
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


def _write_input(work: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = work / "items.parquet"
    pq.write_table(pa.table({"text": texts}), inp)
    return inp


def overhead(args: argparse.Namespace) -> None:
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
    inp = _write_input(work, texts)

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
                          max_new_tokens=new_tokens, temperature=0.0, shard_items=max(batch_size, 500),
                          prompt_format="raw", threads=torch.get_num_threads())
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


STRUCTURED_COLS = ["engine", "constrained", "device", "items", "batch_size", "max_new_tokens", "valid_frac",
                   "items_per_s", "decode_ms_per_step", "overhead_pct", "card", "date"]


def _valid_frac(comps: list[Any], spec: Any) -> float:
    from thinkcraft.label.template import parse_output

    return sum(parse_output(c.text, spec).error is None for c in comps) / max(1, len(comps))


def structured_gpu(args: argparse.Namespace, kind: str, device: str) -> list[dict[str, Any]]:
    """Constrained vs unconstrained decoding of the same chat-formatted batches through one engine, for two
    schemas: `action:string` (a JSON string: the matcher's costliest state, and a random model never closes
    it, so its valid fraction says nothing) and the Craftax-Classic actions as an enum (a random model's
    answers complete: valid_frac 1.0 shows the guarantee). The overhead is per decode step (constrained
    rows stop early: items/s alone would flatter them)."""
    from thinkcraft.envs.text.names import ACTION_NAMES

    engine = make_engine(kind, device)
    rows = []
    for fields in ("action:string", "action:" + "|".join(ACTION_NAMES["craftax-classic"])):
        rows += _structured_pair(args, engine, device, fields)
    return rows


def _structured_pair(args: argparse.Namespace, made: tuple[Any, str], device: str, fields: str
                     ) -> list[dict[str, Any]]:
    import torch

    from thinkcraft.label.prompts import ChatPrompts
    from thinkcraft.label.template import OutputSpec, Template, schema_from_fields
    from thinkcraft.llm.constrained import StructuredOutput
    from thinkcraft.llm.protocol import SamplingParams

    items_n = args.items or (1024 if device == "cuda" else 32)
    batch_size = args.batch_size or (256 if device == "cuda" else 16)
    new_tokens = args.max_new_tokens or (32 if device == "cuda" else 8)
    engine, engine_name = made
    schema = schema_from_fields(fields)
    template = Template(prefix=PREFIX, item="{text}", output=OutputSpec(schema))
    prompts = ChatPrompts(engine.tokenizer, template.instructions)
    texts = synthetic_states(items_n)
    batches = [pb.batch for a in range(0, items_n, batch_size) for pb in prompts.batches(texts[a:a + batch_size])]
    spec = StructuredOutput.from_schema(schema)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def once(constrained: bool) -> tuple[float, list[Any], float, int]:
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, logprobs=False, seed=0,
                            structured=spec if constrained else None)
        sync()
        t0 = time.perf_counter()
        comps, decode_s, steps = [], 0.0, 0
        for b in batches:
            comps += engine.generate(b, sp)
            decode_s += engine.last_generate_timing["decode_s"]
            steps += engine.last_generate_timing["decode_steps"]
        sync()
        return time.perf_counter() - t0, comps, decode_s, steps

    once(True)  # warm-up: grammar compile (cached), kernels, allocator
    once(False)
    best: dict[bool, tuple[float, list[Any], float, int]] = {}
    for _ in range(args.repeats):  # alternate, keep the best of each
        for constrained in (False, True):
            r = once(constrained)
            if constrained not in best or r[0] < best[constrained][0]:
                best[constrained] = r
    rows = []
    for constrained in (False, True):
        wall, comps, decode_s, steps = best[constrained]
        rows.append({"engine": engine_name, "constrained": constrained, "device": device, "items": items_n,
                     "fields": "action:string" if fields == "action:string" else "action:<classic actions>",
                     "batch_size": batch_size, "max_new_tokens": new_tokens,
                     "valid_frac": round(_valid_frac(comps, template.output), 4),
                     "items_per_s": round(items_n / wall, 3),
                     "decode_ms_per_step": round(1e3 * decode_s / max(1, steps), 3),
                     "card": card(), "date": today(), "quick": args.quick})
    # per decode step: the constrained rows' extra host and device work (goal <= 10%)
    rows[1]["overhead_pct"] = round(100.0 * (rows[1]["decode_ms_per_step"] / rows[0]["decode_ms_per_step"] - 1), 2)
    return rows


def structured_cpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The bundled model through `label()` as the CLI runs it: first-pass valid fraction and items/s."""
    from thinkcraft.label.pipeline import LabelConfig, label

    items_n = args.items or 64
    work = Path(tempfile.mkdtemp(prefix="bench-label-"))
    inp = _write_input(work, synthetic_states(items_n))
    rows = []
    for constrained in (True, False):
        cfg = LabelConfig(input=str(inp), out_dir=str(work / f"out-{constrained}"), engine="hf:default",
                          fields="action:string", max_new_tokens=args.max_new_tokens or 32,
                          batch_size=args.batch_size or 64, constrain=constrained, schema_retries=0)
        rep = label(cfg)
        rows.append({"engine": "hf:smollm2-135m", "constrained": constrained, "device": "cpu", "items": items_n,
                     "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
                     "valid_frac": round(rep["first_pass_valid_frac"], 4), "items_per_s": round(rep["items_per_s"], 4),
                     "threads": rep["threads"], "prompt_format": rep["prompt_format"],
                     "card": card(), "date": today(), "quick": False})
    shutil.rmtree(work, ignore_errors=True)
    return rows


def busy(args: argparse.Namespace) -> None:
    """Bundled-model labelling with torch's default threads vs auto, idle and beside a busy-loop process."""
    import os
    import subprocess

    import torch

    from thinkcraft.label.pipeline import LabelConfig, label
    from thinkcraft.label.threads import usable_cpus

    items_n = args.items or 16
    work = Path(tempfile.mkdtemp(prefix="bench-label-"))
    inp = _write_input(work, synthetic_states(items_n))
    default_threads = usable_cpus()
    rows = []
    for busy_procs in (0, 1):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_procs)]
        try:
            for threads in (default_threads, 0):
                run = work / f"out-{busy_procs}-{threads}"
                cfg = LabelConfig(input=str(inp), out_dir=str(run), engine="hf:default", fields="action:string",
                                  max_new_tokens=args.max_new_tokens or 32, batch_size=args.batch_size or 16,
                                  threads=threads)
                rep = label(cfg)
                rows.append({"engine": "hf:smollm2-135m", "threads": "auto" if threads == 0 else threads,
                             "threads_used": rep["threads"], "busy_procs": busy_procs, "items": items_n,
                             "items_per_s": round(rep["items_per_s"], 4), "elapsed_s": rep["elapsed_s"],
                             "load_1min": round(os.getloadavg()[0], 2), "card": card(), "date": today()})
                shutil.rmtree(run, ignore_errors=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    torch.set_num_threads(default_threads)
    shutil.rmtree(work, ignore_errors=True)
    print_table(rows, ["threads", "threads_used", "busy_procs", "items", "items_per_s", "elapsed_s", "load_1min"])
    out = Path(args.out).with_name("label_threads.json")
    print(f"wrote {write_records(out, rows, merge_keys=('engine', 'threads', 'busy_procs', 'items', 'card'))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["structured", "overhead", "busy"], default="overhead")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny random model, few items")
    ap.add_argument("--model", choices=["auto", "tiny", "bundled", "4b"], default="auto",
                    help="auto: 4b on GPU, bundled on CPU (tiny with --quick)")
    ap.add_argument("--items", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "label.json"))
    args = ap.parse_args()
    if args.mode == "overhead":
        return overhead(args)
    if args.mode == "busy":
        return busy(args)
    import torch

    gpu = torch.cuda.is_available() and not args.quick
    if gpu or args.quick or args.model in ("tiny", "4b"):
        kind = args.model if args.model != "auto" else ("4b" if gpu else "tiny")
        rows = structured_gpu(args, kind, "cuda" if gpu else "cpu")
    else:
        rows = structured_cpu(args)
    print_table(rows, STRUCTURED_COLS)
    path = write_records(args.out, rows, merge_keys=("engine", "constrained", "device", "items", "card", "quick"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
