"""What does one decode step of the llm-policy engine cost, and where does it go? The same weights served as
`train llm-policy --finetune lora` serves them (PEFT LoRA on every linear, fp32 adapters under bf16 autocast)
and merged into a plain model (`merge_and_unload`: the upper bound of any LoRA speed-up in the engine), over
the static and the dynamic decode width.

Why (issue 19, 2026-11-28, H200): the Craftax rollout's decode step took 7.2 ms at ~213 rows with the host
waiting only 1.1 ms of it (host-bound), its CUDA graph ~1,500 kernels, LoRA ~0.8 ms of the ~4 ms of device
time (BENCHMARKS §7b). This probe isolates the step from the env, the prompts and the prefill, so one short GPU
call says what each lever is worth before it is built.

    python bench/probes/decode_step_probe.py                          # GPU: qwen2.5-0.5b shape, 256 rows
    PYTHONPATH=src python bench/probes/decode_step_probe.py --quick    # CPU smoke run (tiny shape, eager)

Each case: `rows` requests of a shared prefix + `context` random tokens, `new_tokens` sampled each (temperature
1, logprobs, as the rollout samples); one warm-up round (compiles, captures), then `repeats` measured rounds.
Rows: {variant, kv_cache, rows, context, decode_ms_per_step, decode_wait_ms (the host waiting for the device:
near the step = device-bound, near 0 = host-bound), host_ms (the rest), prefill_s, graph_captures, card,
date} in bench/results/decode_step_probe.json (`--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from common import card, print_table, today, torch_profile, write_records  # noqa: E402

VARIANTS = ("lora-peft", "lora", "lora-merge", "merged")
COLS = ["variant", "kv_cache", "rows", "context", "decode_ms_per_step", "decode_wait_ms", "host_ms",
        "rows_per_step", "prefill_s", "graph_captures"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prefix", type=int, default=300, help="shared-prefix tokens (the system prompt)")
    p.add_argument("--context", type=int, default=1000, help="tokens of each row after the prefix")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="lora-peft: PEFT's own LoRA forward (THINKCRAFT_LORA_FAST=0); lora: the engine's default "
                        "(llm/hf/lora_fast.py: bf16 adapter copies, no casts); lora-merge: its opt-in merged weights "
                        "(THINKCRAFT_LORA_MERGE=1, refreshed with the adapters); merged: merge_and_unload (the bound); "
                        "run in this order whatever the order given (the fast forward and merging change the model)")
    p.add_argument("--kv-cache", nargs="+", default=["static", "dynamic"], choices=["static", "dynamic"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="one more round per case, its decode steps (after the admitting step) under torch.profiler: "
                        "<out>_profile-<case>.{txt,json} and _all.tsv (every kernel)")
    p.add_argument("--host-profile", action="store_true",
                   help="one more round per case under cProfile: <out>_host-<case>.txt, the host's time by Python "
                        "function (sampling, bookkeeping, the graph's replay, the collect), cumulative and own")
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shape, 4 rows, short contexts")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_step_probe.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.shape, a.rows, a.prefix, a.context, a.new_tokens, a.repeats, a.device = "tiny", 4, 16, 24, 6, 1, "cpu"
        a.out = str(Path(a.out).with_name("decode_step_probe_quick.json"))
    for name in ("rows", "prefix", "context", "new_tokens", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def _policy(a: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(PEFT model, tokenizer, device): the llm-policy's own loader, the adapters' B made non-zero (a fresh
    adapter adds exactly 0; a trained one computes)."""
    import torch

    from thinkcraft.train.llm_policy.config import LLMPolicyConfig
    from thinkcraft.train.llm_policy.model import _device, load_policy

    cfg = LLMPolicyConfig(model=f"random:{a.shape}", finetune="lora", device=a.device, store=False, plot=False)
    device = _device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    corpus = [f"observation {i}: a tree to the north, water {i % 7} steps east; inventory wood {i % 5}" for i in range(200)]
    model, tok = load_policy(cfg, corpus, device, dtype)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "lora_B" in name:
                prm.normal_(0.0, 1e-3)
    return model, tok, device


def _round(engine: Any, prompts: list[list[int]], prefix: int, new_tokens: int) -> dict[str, float]:
    from thinkcraft.llm.protocol import GenerationRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, logprobs=True)
    from thinkcraft.train.llm_policy.rollout import decode_metrics_delta

    before = engine.decode_metrics()
    t0 = time.perf_counter()
    handles = {engine.submit(GenerationRequest(p, sp, prefix_len=prefix)) for p in prompts}
    while handles:
        engine.step()
        handles -= {r.handle for r in engine.poll()}
    wall = time.perf_counter() - t0
    d = decode_metrics_delta(before, engine.decode_metrics())  # the rollout's own per-step means
    return {"wall_s": wall, "decode_ms": d["engine/decode_step_ms"], "wait_ms": d["engine/decode_wait_ms"],
            "prefill_s": d["engine/prefill_s"], "rows_per_step": d["engine/rows_per_decode_step"],
            "captures": d["engine/graph_captures"],
            # THINKCRAFT_DEVICE_TIMING=1 (llm/hf/device_timing.py): the device's time a phase and between phases
            **{k[len("engine/"):]: v for k, v in d.items() if k.startswith("engine/dev_") and k.endswith("_ms")}}


def _profile_decode(engine: Any, prompts: list[list[int]], prefix: int, new_tokens: int, cuda: bool, base: Path,
                    label: str) -> None:
    """One more round with its decode steps alone under torch.profiler: the first step (every prompt admitted and
    prefilled, the first iteration launched) runs before the profiler starts."""
    from thinkcraft.llm.protocol import GenerationRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, logprobs=True)
    handles = {engine.submit(GenerationRequest(p, sp, prefix_len=prefix)) for p in prompts}
    engine.step()
    handles -= {r.handle for r in engine.poll()}
    steps = [0]

    def rest() -> None:
        nonlocal handles
        while handles:
            engine.step()
            steps[0] += 1
            handles -= {r.handle for r in engine.poll()}

    torch_profile(rest, cuda, base, f"{label} ({new_tokens} decode steps after the admitting step)")
    print(f"  profiled {steps[0]} engine steps", flush=True)


def measure(a: argparse.Namespace, model: Any, tok: Any, device: Any, variant: str, width: str) -> dict[str, Any]:
    import contextlib

    import torch

    from thinkcraft.llm.hf import HFEngine

    cuda = device.type == "cuda"
    with _env("THINKCRAFT_LORA_FAST", "0" if variant == "lora-peft" else None), \
            _env("THINKCRAFT_LORA_MERGE", "1" if variant == "lora-merge" else "0"):
        engine = HFEngine.from_model(model, tok, kv_cache=width, compile_decode=cuda, max_batch_size=a.rows)
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    prefix = [rng.choice(vocab) for _ in range(a.prefix)]
    prompts = [prefix + [rng.choice(vocab) for _ in range(a.context)] for _ in range(a.rows)]
    # the learner's autocast (bf16 on CUDA over fp32 adapters), as the rollout runs the engine
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    with ctx():
        warm = _round(engine, prompts, a.prefix, a.new_tokens)
        runs = [_round(engine, prompts, a.prefix, a.new_tokens) for _ in range(a.repeats)]
        if a.profile:
            label = f"{variant}-{width}-{a.rows}rows"
            _profile_decode(engine, prompts, a.prefix, a.new_tokens, cuda,
                            Path(a.out).with_name(f"{Path(a.out).stem}_profile-{label}"), label)
        if a.host_profile:
            _host_profile(lambda: _round(engine, prompts, a.prefix, a.new_tokens),
                          Path(a.out).with_name(f"{Path(a.out).stem}_host-{variant}-{width}-{a.rows}rows.txt"))
    med = lambda k: round(statistics.median(r[k] for r in runs), 3)  # noqa: E731
    engine.free_cache()
    return {"variant": variant, "lora_fast_layers": len(engine._lora_fast),
            # q/k/v and gate/up groups as one GEMM each (llm/hf/fused_proj.py; THINKCRAFT_FUSED_PROJ=0: none)
            "fused_proj_groups": len(getattr(engine, "_fused_proj", None) or []),
            # of them with the adapters' A inside the base GEMM (THINKCRAFT_FOLD_LORA_A=0: none)
            "fused_proj_folded": sum(g.fold for g in getattr(engine, "_fused_proj", None) or []),
            "kv_cache": width, "shape": a.shape, "rows": a.rows, "prefix": a.prefix,
            "context": a.context, "new_tokens": a.new_tokens, "decode_ms_per_step": med("decode_ms"),
            "decode_wait_ms": med("wait_ms"), "host_ms": round(med("decode_ms") - med("wait_ms"), 3),
            "rows_per_step": med("rows_per_step"), "prefill_s": med("prefill_s"),
            "graph_captures": warm["captures"] + sum(r["captures"] for r in runs), "warmup_s": round(warm["wall_s"], 1),
            "repeats": a.repeats, "card": card(), "date": today(), "quick": a.quick,
            **{k: med(k) for k in sorted(runs[0]) if k.startswith("dev_")}}


def _host_profile(run: Any, path: Path) -> None:
    """One round under cProfile, written as the top functions by cumulative and by own time (cProfile slows
    the Python it sees, not the kernels: the ranking of host costs, not their exact share)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    out = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
    path.write_text(out.getvalue())
    print(f"host profile: {path}", flush=True)


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` for the block (None: left as it is)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    model, tok, device = _policy(a)
    rows = []
    for variant in [v for v in VARIANTS if v in a.variants]:  # PEFT's forward, then the fast one, then merged
        if variant == "merged":
            model = model.merge_and_unload()
        for width in a.kv_cache:
            rows.append(measure(a, model, tok, device, variant, width))
            print({k: rows[-1][k] for k in COLS}, flush=True)
    write_records(a.out, rows, merge_keys=("variant", "kv_cache", "shape", "rows", "context", "card", "quick",
                                           "fused_proj_groups", "fused_proj_folded"))
    print_table(rows, COLS)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
