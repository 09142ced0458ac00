"""hf engine benchmark: shared-prefix hidden states and generation decode speed.

    .venv/bin/python bench/engine.py            # GPU: Qwen3-4B-shaped model, random bf16 weights
    .venv/bin/python bench/engine.py --quick    # CPU smoke run (tiny shapes, seconds)
    # under a per-command time limit, run the parts separately into one JSON:
    .venv/bin/python bench/engine.py --skip-decode
    .venv/bin/python bench/engine.py --skip-hidden --merge          # or --decode-batches 128, then 512

Model: Qwen3-4B's shape built from its config with random weights (36 layers, hidden 2560, 32/8 heads of
128, MLP 9728, vocab 151936, tied embeddings); timing does not depend on the values.

Hidden states (items = 800-token shared prefix + 100-150-token suffix, last-token pooling, last layer):
  raw_hf         the suffixes alone through the eager HF decoder forward (ANCHORS' "raw prefill")
  raw            the suffixes alone (no prefix at all) through the engine (compiled layers on CUDA)
  no_reuse       prefix + suffix as one 900-950-token sequence per item (the plain HF path)
  reuse_first    cascade attention, first call (includes the batch-1 prefix prefill)
  reuse          cascade attention, steady (prefix KV cached across calls)
  repeat_kv      plain HF reuse: prefix KV repeated over the batch (`DynamicCache.batch_repeat_interleave`)
                 - the calibration row of ANCHORS.md (72% of raw, out of memory at 512 items)
Goal: reuse suffix tok/s >= 90% of raw, at 128 and 1024 items. Each reuse row also records the max
|reuse - no_reuse| over the first items (bf16), a correctness check on the real kernels.

Generation (300-token prompts, 128 new tokens, greedy, no EOS), at batch 128 and 512:
decode_tok_per_s = batch x 128 / (wall s of the generate call - its prefill s), e2e_tok_per_s = batch x 128 /
wall s (prefill included); the prefill end is marked by a device sync at the first logits processor
call (hf) / after the prompt forward (engine):
  hf_generate        transformers `model.generate` (dynamic cache): the reference, same run
  engine_dynamic     our loop, dynamic cache
  engine_static      our loop, static cache
  engine_compiled    our loop, static cache + torch.compile(mode="reduce-overhead") decode step (CUDA only)
  hf_generate_static, hf_continuous_batching   more transformers references (CUDA only; prefill included)
Goal: decode >= 3x hf_generate.

Prints a table and writes bench/results/engine.json (rows with kind, batch, prefix_tokens, suffix_tokens,
seconds, suffix_tok_per_s, decode_tok_per_s, card, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from thinkcraft.llm.hf import HFEngine  # noqa: E402
from thinkcraft.llm.protocol import Batch, SamplingParams  # noqa: E402
from thinkcraft.llm.testing import qwen3_4b_config  # noqa: E402


class BenchTokenizer:
    """Just enough tokenizer for token-id batches on a random-weight model (no EOS, empty text)."""

    pad_token_id = 0
    eos_token_id = None
    bos_token = None
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def build_model(quick: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    over: dict[str, Any] = {}
    if quick:
        over = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = qwen3_4b_config(**over)
    cfg.eos_token_id = None  # generation runs to max_new_tokens in every variant
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def repeat_kv_fn(eng: HFEngine, prefix: list[int], items: list[list[int]]) -> Callable[[], torch.Tensor]:
    """ANCHORS' calibration: the prefix KV prefilled once and repeated over the batch (outside the timed
    call); each call forwards the suffixes with the plain HF path against it, gathers each last real
    token, and crops the cache back to the prefix."""
    from transformers import DynamicCache

    dev = eng.device
    with torch.no_grad():
        cache = DynamicCache(config=eng._lm.config)
        eng._dec(input_ids=torch.tensor([prefix], device=dev), use_cache=True, **{eng._cache_kw: cache})
        cache.batch_repeat_interleave(len(items))
    ids, mask = eng._pad(items, "right")
    p = len(prefix)
    full_mask = torch.cat([torch.ones((len(items), p), dtype=mask.dtype, device=dev), mask], 1)
    pos = (p + torch.arange(ids.shape[1], device=dev))[None, :].expand_as(ids)
    rows = torch.arange(len(items), device=dev)

    def call() -> torch.Tensor:
        with torch.no_grad():
            out = eng._dec(input_ids=ids, attention_mask=full_mask, position_ids=pos, use_cache=True, **{eng._cache_kw: cache})
            h = out.last_hidden_state[rows, mask.sum(1) - 1].float()
            cache.crop(-ids.shape[1])
        return h

    return call


def bench_hidden(eng: HFEngine, args: argparse.Namespace, device: torch.device, rows: list[dict]) -> None:
    rng = np.random.default_rng(0)
    vocab = eng._lm.config.vocab_size
    prefix = rng.integers(10, vocab, args.prefix_tokens).tolist()
    lo, hi = args.suffix_tokens
    for n in args.hidden_batches:
        items = [rng.integers(10, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
        suffix_tokens = sum(len(it) for it in items)
        base = dict(batch=n, prefix_tokens=args.prefix_tokens, suffix_tokens=suffix_tokens)

        def record(kind: str, seconds: float, **extra: Any) -> None:
            rows.append(dict(kind=kind, **base, seconds=round(seconds, 4),
                             suffix_tok_per_s=round(suffix_tokens / seconds, 1), decode_tok_per_s=None,
                             peak_gb=peak_gb(device), **extra))
            print(f"  hidden {kind:<12} n={n:<5} {seconds:8.3f} s  {suffix_tokens / seconds:>10,.0f} suffix tok/s", flush=True)

        plain_b = Batch(items=items)
        with_prefix = Batch(items=items, prefix=prefix)
        hf_ids, hf_mask = eng._pad(items, "right")

        def raw_hf() -> torch.Tensor:  # ANCHORS' raw prefill: the eager HF decoder forward, nothing else
            with torch.no_grad():
                return eng._dec(input_ids=hf_ids, attention_mask=hf_mask, use_cache=False).last_hidden_state[:, -1]

        variants: list[tuple[str, Callable[[], Any]]] = [
            ("raw_hf", raw_hf),
            ("raw", lambda: eng.hidden_states_torch(plain_b, prefix_reuse=False)),
            ("no_reuse", lambda: eng.hidden_states_torch(with_prefix, prefix_reuse=False)),
        ]
        for kind, fn in variants:
            free(device)
            try:
                timed(fn, device) if args.warmup else None
                s, _ = timed(fn, device)
                record(kind, s)
            except torch.OutOfMemoryError:
                rows.append(dict(kind=kind, **base, seconds=None, error="out of memory"))
                print(f"  hidden {kind:<12} n={n:<5} out of memory", flush=True)
        # cascade reuse: first call (prefix prefill included), then steady
        free(device)
        eng.invalidate_prefix_cache()
        if args.warmup:  # kernels/autotune warm on another prefix, so "first" measures the prefix cost only
            eng.hidden_states_torch(Batch(items=items, prefix=prefix[:-1] + [prefix[-1] - 1]))
            eng.invalidate_prefix_cache()
        s_first, _ = timed(lambda: eng.hidden_states_torch(with_prefix, prefix_reuse=True), device)
        s, got = timed(lambda: eng.hidden_states_torch(with_prefix, prefix_reuse=True), device)
        k = min(16, n)
        ref = eng.hidden_states_torch(Batch(items=items[:k], prefix=prefix), prefix_reuse=False)
        diff = float((got[:k] - ref).abs().max())
        scale = float(ref.abs().max())
        record("reuse_first", s_first)
        record("reuse", s, max_abs_diff_vs_no_reuse=round(diff, 5), max_abs_ref=round(scale, 3))
        # ANCHORS' calibration: plain HF reuse with repeated KV
        free(device)
        try:
            fn = repeat_kv_fn(eng, prefix, items)
            timed(fn, device) if args.warmup else None
            s, _ = timed(fn, device)
            record("repeat_kv", s)
        except torch.OutOfMemoryError:
            rows.append(dict(kind="repeat_kv", **base, seconds=None, error="out of memory"))
            print(f"  hidden repeat_kv    n={n:<5} out of memory", flush=True)
        free(device)


def bench_decode(model: torch.nn.Module, args: argparse.Namespace, device: torch.device, rows: list[dict]) -> None:
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    new = args.new_tokens
    tok = BenchTokenizer()
    engines = {
        "engine_dynamic": HFEngine.from_model(model, tok, kv_cache="dynamic", max_batch_size=4096),
        "engine_static": HFEngine.from_model(model, tok, kv_cache="static", max_batch_size=4096),
    }
    if device.type == "cuda" and not args.no_compile:
        engines["engine_compiled"] = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True, max_batch_size=4096)
    for b in args.decode_batches:
        prompts = rng.integers(10, vocab, (b, args.prompt_tokens))
        base = dict(batch=b, prefix_tokens=0, suffix_tokens=int(prompts.size))

        def record(kind: str, seconds: float, prefill_s: float, **extra: Any) -> None:
            decode_s = seconds - prefill_s
            rows.append(dict(kind=kind, **base, seconds=round(seconds, 4), suffix_tok_per_s=None,
                             decode_tok_per_s=round(b * new / decode_s, 1), e2e_tok_per_s=round(b * new / seconds, 1),
                             prefill_s=round(prefill_s, 4), new_tokens=new, peak_gb=peak_gb(device), **extra))
            print(f"  decode {kind:<16} b={b:<5} {seconds:8.3f} s (prefill {prefill_s:6.3f} s)  "
                  f"{b * new / decode_s:>10,.0f} decode tok/s  {b * new / seconds:>10,.0f} end-to-end", flush=True)

        ids = torch.tensor(prompts, device=device)
        first_logits_at: list[float] = []

        def mark_first(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            # called once per step after the forward: the first call marks the end of the prefill
            if not first_logits_at:
                sync(device)
                first_logits_at.append(time.perf_counter())
            return scores

        def hf_generate(k: int = new) -> torch.Tensor:
            from transformers import LogitsProcessorList

            first_logits_at.clear()
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                      min_new_tokens=k, do_sample=False, pad_token_id=0,
                                      logits_processor=LogitsProcessorList([mark_first]))

        free(device)
        try:
            if args.warmup:  # a short run warms kernels and the allocator at this batch size
                timed(lambda: hf_generate(4), device)
            sync(device)
            t_start = time.perf_counter()
            s, out = timed(hf_generate, device)
            assert out.shape[1] == args.prompt_tokens + new
            record("hf_generate", s, first_logits_at[0] - t_start)
        except torch.OutOfMemoryError:
            rows.append(dict(kind="hf_generate", **base, seconds=None, error="out of memory"))
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, logprobs=True)
        batch = Batch(items=prompts.tolist())
        ref_tokens = None
        for kind, eng in engines.items():
            free(device)
            try:
                if kind == "engine_compiled":  # compile + CUDA-graph capture need the exact shapes; excluded
                    t_warm, _ = timed(lambda: eng.generate(batch, sp), device)
                    print(f"  decode {kind:<16} b={b:<5} first call (compile) {t_warm:.1f} s", flush=True)
                elif args.warmup:
                    timed(lambda: eng.generate(batch, SamplingParams(max_new_tokens=4, temperature=0.0)), device)
                s, cs = timed(lambda: eng.generate(batch, sp), device)
                assert all(len(c.token_ids) == new for c in cs)
                same = None
                if ref_tokens is None:
                    ref_tokens = [c.token_ids for c in cs[:8]]
                else:  # bf16 greedy can flip near-ties between kernels; report agreement, do not fail
                    same = float(np.mean([a == c.token_ids for a, c in zip(ref_tokens, cs[:8])]))
                record(kind, s, eng.last_generate_timing["prefill_s"], **({} if same is None else {"same_tokens_as_dynamic": same}))
            except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
                msg = "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"
                rows.append(dict(kind=kind, **base, seconds=None, error=msg[:500]))
                print(f"  decode {kind:<16} b={b:<5} FAILED: {msg[:200]}", flush=True)
                if not isinstance(e, torch.OutOfMemoryError):
                    traceback.print_exc()
            finally:
                eng.free_cache()  # each engine's slot KV cache gone before the next engine measures
        # last: a failure inside third-party graph capture must not cost the rows above
        if device.type == "cuda" and not args.no_compile:
            extra_refs(model, ids, new, device, record, rows, base)
        # drop the cache transformers keeps for CUDA-graph reuse before the next batch size
        if getattr(model, "_cache", None) is not None:
            model._cache = None
        free(device)


def extra_refs(model: torch.nn.Module, ids: torch.Tensor, new: int, device: torch.device,
               record: Callable[..., None], rows: list[dict], base: dict) -> None:
    """More transformers references on CUDA (wall time incl. prefill, reported with prefill_s=0):
    `generate` with a static cache (transformers auto-compiles its decode step), and continuous
    batching (`generate_batch`, paged attention). Failures are recorded, not raised."""
    from transformers import GenerationConfig

    def static() -> Any:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0, cache_implementation="static")

    def continuous() -> Any:
        cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            out = model.generate_batch(inputs=ids.tolist(), generation_config=cfg)
        n = sum(len(o.generated_tokens) for o in out.values())
        assert n == ids.shape[0] * new, f"continuous batching generated {n} tokens, expected {ids.shape[0] * new}"
        return out

    for kind, fn in (("hf_generate_static", static), ("hf_continuous_batching", continuous)):
        free(device)
        try:
            t_warm, _ = timed(fn, device)
            s, _ = timed(fn, device)
            record(kind, s, 0.0, first_call_s=round(t_warm, 2), note="prefill included in decode_tok_per_s")
        except Exception as e:  # noqa: BLE001
            msg = "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"
            rows.append(dict(kind=kind, **base, seconds=None, error=msg[:500]))
            print(f"  decode {kind:<16} b={base['batch']:<5} FAILED: {msg[:200]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine.json"))
    ap.add_argument("--skip-hidden", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile decode variant")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="engine chunk size for hidden states")
    ap.add_argument("--hidden-batches", type=int, nargs="+", default=None, help="override the hidden-state batch sizes")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=None, help="override the decode batch sizes")
    ap.add_argument("--merge", action="store_true",
                    help="keep rows of an existing --out file unless re-measured (run the parts in separate commands)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden_override, decode_override = args.hidden_batches, args.decode_batches
    if args.quick:
        args.hidden_batches, args.prefix_tokens, args.suffix_tokens = [8, 32], 64, (10, 15)
        args.decode_batches, args.prompt_tokens, args.new_tokens = [4, 8], 30, 8
    else:
        args.hidden_batches, args.prefix_tokens, args.suffix_tokens = [128, 1024], 800, (100, 150)
        args.decode_batches, args.prompt_tokens, args.new_tokens = [128, 512], 300, 128
    args.warmup = True
    args.hidden_batches = hidden_override or args.hidden_batches
    args.decode_batches = decode_override or args.decode_batches
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench/engine.py on {card} ({'quick' if args.quick else 'full'}), torch {torch.__version__}", flush=True)
    t0 = time.time()
    model = build_model(args.quick, device, dtype)
    print(f"  model built in {time.time() - t0:.1f} s: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params", flush=True)
    from thinkcraft.utils.io import atomic_write_json

    out = Path(args.out)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

    class Rows(list):
        """Rows saved to the JSON on every append: a crash late in the run keeps what was measured."""

        def append(self, r: dict) -> None:
            r.update(card=card, date=date, quick=args.quick)
            super().append(r)
            atomic_write_json(out, {"rows": merged(self), "summary": summarise(merged(self)), "card": card, "date": date,
                                    "quick": args.quick, "torch": torch.__version__, "complete": False})

    def merged(new_rows: list[dict]) -> list[dict]:
        fresh = {(r["kind"], r["batch"]) for r in new_rows}
        return [r for r in previous if (r["kind"], r["batch"]) not in fresh] + list(new_rows)

    rows = Rows()
    previous: list[dict] = []
    if args.merge and out.is_file():
        previous = json.loads(out.read_text()).get("rows", [])
    if not args.skip_hidden:
        eng = HFEngine.from_model(model, BenchTokenizer(), max_batch_tokens=args.max_batch_tokens)
        bench_hidden(eng, args, device, rows)
    if not args.skip_decode:
        bench_decode(model, args, device, rows)
    summary = summarise(merged(rows))
    atomic_write_json(out, {"rows": merged(rows), "summary": summary, "card": card, "date": date, "quick": args.quick,
                            "torch": torch.__version__, "complete": True})
    print("\nsummary:")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    print(f"wrote {out}")
    return 0


def summarise(rows: list[dict]) -> dict[str, Any]:
    """Goal ratios: reuse / raw suffix tok/s per batch; best engine decode / hf_generate per batch."""
    out: dict[str, Any] = {}
    by = {(r["kind"], r["batch"]): r for r in rows if r.get("seconds")}
    for (kind, b), r in by.items():
        if kind == "reuse" and ("raw", b) in by:
            out[f"reuse_vs_raw_prefill@{b}"] = round(r["suffix_tok_per_s"] / by[("raw", b)]["suffix_tok_per_s"], 3)
        if kind == "reuse" and ("raw_hf", b) in by:
            out[f"reuse_vs_raw_hf_prefill@{b}"] = round(r["suffix_tok_per_s"] / by[("raw_hf", b)]["suffix_tok_per_s"], 3)
        if kind == "hf_generate":
            best = max((by[(k, b)]["decode_tok_per_s"], k) for k in ("engine_dynamic", "engine_static", "engine_compiled") if (k, b) in by) if any((k, b) in by for k in ("engine_dynamic", "engine_static", "engine_compiled")) else None
            if best:
                out[f"decode_vs_hf_generate@{b}"] = {"ratio": round(best[0] / r["decode_tok_per_s"], 2), "best": best[1]}
    return out


if __name__ == "__main__":
    sys.exit(main())
