"""What does attending to the shared prefix cost the hidden-state prefill, and which layout of it is cheapest?

    python bench/probes/cascade_probe.py              # GPU only; ppo-hidden's shapes at 128 envs (Qwen3-4B heads)

1. One layer's attention at B suffixes of S tokens after a P-token prefix (H query heads, Hkv KV heads),
   eager and under torch.compile (how the engine runs its layers), CUDA-event median of 20:
   - `suffix_only`   causal attention over the suffix alone (what a prompt without prefix costs)
   - `cascade_fold`  prefix part with the GQA group folded into the query rows (a copy of q), suffix part
                     with K/V expanded to H heads (the engine before this probe)
   - `cascade_gqa`   the kernel maps GQA heads itself: q folded by a view, no K/V expansion (the engine's
                     two-part path where varlen is unavailable)
   - `varlen`        one FlashAttention varlen call per layer over per-item [prefix | suffix] keys (the
                     prefix KV copied per item), no merge (the engine's path on CUDA): torch's private op
   - `varlen_public` the same through torch's public `torch.nn.attention.varlen.varlen_attn` (a candidate
                     to replace the private op: `attention.VARLEN_KERNELS["public"]`)
   all checked against each other on the same inputs.
2. In the engine, the Qwen3-4B-shaped random model on compact texts of fresh Craftax-Symbolic envs: hidden
   states with ppo-hidden's prompt prefix (the two-part cascade in both layouts, the varlen call through the
   private op and through the public API) and
   without a prefix (the raw rate the skip_n=1 limit is defined by), tokens/s.
Writes bench/results/cascade_probe.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (common.py)
from common import card, cuda_timed as timed, today, write_records  # noqa: E402


def attention_variants(b: int, s: int, p: int, h: int, hkv: int, d: int) -> list[dict]:
    import torch

    import thinkcraft.llm.attention as A

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device=dev, dtype=dt).transpose(1, 2)  # as transformers hands it over
    k = torch.randn(b, hkv, s, d, device=dev, dtype=dt)
    v = torch.randn(b, hkv, s, d, device=dev, dtype=dt)
    pk = torch.randn(1, hkv, p, d, device=dev, dtype=dt)
    pv = torch.randn(1, hkv, p, d, device=dev, dtype=dt)
    scale = d**-0.5
    native = A.probe_gqa_native(dev)
    print(f"flash takes GQA K/V directly: {native}", flush=True)

    def suffix_only():
        o, _ = A.attention_lse(q, k, v, True, scale)
        return o.transpose(1, 2).contiguous()

    def cascade():  # the layout follows A._GQA_NATIVE, set per variant below (outside compiled code)
        return A.shared_prefix_attention(q, k, v, pk, pv, scale=scale).transpose(1, 2).contiguous()

    def varlen(kernel):  # noqa: ANN001, ANN202 - per item keys [prefix | own suffix], one call, no merge
        return lambda: A.varlen_prefix_attention(q, k, v, pk, pv, scale, A.VARLEN_KERNELS[kernel]).transpose(1, 2)

    variants = {"suffix_only": suffix_only, "cascade_fold": cascade, "cascade_gqa": cascade,
                "varlen": varlen("aten"), "varlen_public": varlen("public")}
    A._GQA_NATIVE["cuda"] = False
    ref = cascade()
    out = []
    for name, fn in variants.items():
        rec = {"probe": "attention", "variant": name, "B": b, "S": s, "P": p, "H": h, "Hkv": hkv, "d": d}
        A._GQA_NATIVE["cuda"] = native if name != "cascade_fold" else False
        if name == "cascade_gqa" and not native:
            continue
        try:
            torch._dynamo.reset()
            got = fn()
            if name != "suffix_only":
                rec["max_abs_diff_vs_fold"] = float((got.float() - ref.float()).abs().max())
            rec["eager_ms"] = 1e3 * timed(fn)
            cfn = torch.compile(fn, dynamic=False)
            rec["compiled_ms"] = 1e3 * timed(cfn)
        except Exception as e:  # noqa: BLE001 - a variant the installed torch lacks is reported, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(rec, flush=True)
        out.append(rec)
    A._GQA_NATIVE["cuda"] = native
    return out


def engine_rates(num_envs: int, layer: int) -> list[dict]:
    import jax
    import torch

    import thinkcraft.llm.attention as A
    from thinkcraft.envs.craftax import make_env
    from thinkcraft.envs.text import render_states
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, make_prompt_prefix
    from ppo_hidden_sps import build_engine

    engine, desc = build_engine(False)
    env = make_env("Craftax-Symbolic-v1", num_envs, 1)
    _, state = jax.jit(env.reset)(jax.random.PRNGKey(0))
    texts = render_states(state, "compact")
    prefix_ids, items = engine.tokenize_batch(Batch(texts, prefix=make_prompt_prefix(PPOHiddenConfig())))
    n_tok = sum(len(i) for i in items)
    native = A._GQA_NATIVE.get("cuda", False)
    chosen = A._VARLEN.get("cuda")  # the engine's choice, restored at the end
    varlen = {kernel: A.probe_varlen("cuda", kernel) for kernel in A.VARLEN_KERNELS}  # which kernels pass the probe
    out = []
    for name, prefix, gqa, vl in (("no_prefix", None, native, None), ("cascade_fold", prefix_ids, False, None),
                                  ("cascade_gqa", prefix_ids, True, None), ("cascade_varlen", prefix_ids, native, "aten"),
                                  ("cascade_varlen_public", prefix_ids, native, "public")):
        if (gqa and not native) or (vl is not None and not varlen[vl]):
            continue
        A._GQA_NATIVE["cuda"], A._VARLEN["cuda"] = gqa, vl
        batch = Batch(items, prefix=prefix)
        for _ in range(2):  # compile / warm-up
            engine.hidden_states_torch(batch, layer)
        ts = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.hidden_states_torch(batch, layer)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        rec = {"probe": "engine", "variant": name, "num_envs": num_envs, "layer": layer, "llm": desc,
               "prefix_tokens": len(prefix_ids) if prefix else 0, "suffix_tokens_per_env": n_tok / num_envs,
               "refresh_ms": 1e3 * t, "tok_per_s": n_tok / t}
        print(rec, flush=True)
        out.append(rec)
    A._GQA_NATIVE["cuda"], A._VARLEN["cuda"] = native, chosen
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-envs", type=int, default=128)
    ap.add_argument("--suffix", type=int, default=104, help="suffix tokens per item (padded chunk width)")
    ap.add_argument("--prefix", type=int, default=238)
    ap.add_argument("--layer", type=int, default=-1)
    ap.add_argument("--no-engine", action="store_true", help="attention micro-benchmark only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "cascade_probe.json"))
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("cascade_probe needs a CUDA GPU")
    recs = attention_variants(a.num_envs, a.suffix, a.prefix, 32, 8, 128)  # Qwen3-4B: 32 query, 8 KV heads
    stamp = {"card": card(), "date": today(), "torch": torch.__version__}
    write_records(a.out, [{**r, **stamp} for r in recs])
    if not a.no_engine:
        recs += engine_rates(a.num_envs, a.layer)
        write_records(a.out, [{**r, **stamp} for r in recs])


if __name__ == "__main__":
    main()
