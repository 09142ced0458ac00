"""ppo-hidden throughput: env steps/s of `train ppo-hidden` at several refresh intervals, with and without
overlap, next to plain PPO at the same shape — all in one run.

    python bench/ppo_hidden_sps.py                      # GPU: Qwen3-4B-shaped random-weight LLM, Craftax-Symbolic
    python bench/ppo_hidden_sps.py --quick              # CPU smoke run: tiny random LLM, Craftax-Classic

The LLM is built from Qwen3-4B's config with random weights (timing does not depend on the values), bf16,
wrapped by the hf engine (shared-prefix reuse on). Texts are tokenized with the bundled SmolLM2 tokenizer
(Qwen's own tokenizer is not available offline; BPE token counts are of the same order).
For each (num_envs, skip_n, overlap) the script runs `train ppo-hidden` for a few updates and reports
the median over the updates after the first (which compiles), with the fraction of steps whose hidden input
was valid (`valid_frac`, rl/hidden.py). `--reset-pool-size auto 0` runs each config with the reset pool
(default) and with the old masked scheme: the before/after of the pool's cost and valid fraction. It also measures the engine's raw prefill
rate on the same texts, which gives the LLM-bound limit `prefill_tok_per_s / suffix_tokens` SPS at skip_n=1.
Writes bench/results/ppo_hidden_sps.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import card, print_table, today, write_records  # noqa: E402


def build_engine(quick: bool, device: str = "cuda:0", quantize: str = "none", layers: int | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import bundled_tokenizer, qwen3_4b_config, tiny_llama

    if quick:
        model, tok = tiny_llama()
        return HFEngine.from_model(model, tok), "tiny-llama (random)"
    tok = bundled_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        cfg = qwen3_4b_config(**({"num_hidden_layers": layers} if layers else {}))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    desc = ("Qwen3-4B shape" + (f" cut to {layers} layer(s)" if layers else "") + " (random, bf16"
            + (", fp8 matmuls)" if quantize == "fp8" else ")"))
    return HFEngine.from_model(model, tok, quantize=quantize), desc


def engine_on(device: str, quick: bool = False, quantize: str = "none"):
    """`build_engine`'s engine alone, on `device`: what each Ray feature actor of bench/scale.py builds (a
    module-level function: the actor imports it by name)."""
    return build_engine(quick, device=device, quantize=quantize)[0]


def prefill_rate(engine, env_name: str, num_envs: int, prefix: list[int] | None = None,
                 profile=None) -> tuple[float, float]:
    """(suffix tokens per env, prefill tokens/s of the suffixes) on real compact texts of `num_envs` fresh
    envs: raw (no prefix: the rate the skip_n=1 limit is defined by), or after a shared `prefix` of token
    ids (the cascade path ppo-hidden runs). `profile(fn)`, when given, is called once after the timed calls
    with one more call of the same batch (e.g. common.torch_profile around it)."""
    import jax
    import torch

    from thinkcraft.envs.craftax import make_env
    from thinkcraft.envs.text import render_states
    from thinkcraft.llm.protocol import Batch

    env = make_env(env_name, num_envs, 1)
    _, state = jax.jit(env.reset)(jax.random.PRNGKey(0))
    texts = render_states(state, "compact")
    _, items = engine.tokenize_batch(Batch(texts))
    n_tok = sum(len(i) for i in items)
    batch = Batch(items, prefix=prefix)
    engine.hidden_states_torch(batch)  # warm-up
    times = []
    for _ in range(5):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.hidden_states_torch(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if profile is not None:
        profile(lambda: engine.hidden_states_torch(batch))
    return n_tok / num_envs, n_tok / statistics.median(times)


def run_one(engine, env_name: str, num_envs: int, num_steps: int, skip_n: int, overlap: bool, updates: int,
            runs_dir: str, plain: bool = False, layer: int = -1, env_sms: int = 16, unroll: bool = False,
            pool: str = "auto") -> dict:
    from thinkcraft.train.ppo import PPOConfig
    from thinkcraft.train.ppo import run as run_ppo
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden import run as run_hidden

    common = dict(env_name=env_name, num_envs=num_envs, num_steps=num_steps, total_timesteps=updates * num_envs * num_steps,
                  runs_dir=runs_dir, overwrite=True, plot=False, checkpoint_every_minutes=0.0,
                  optimistic_reset_ratio=min(16, num_envs), unroll_env_scans="on" if unroll else "off")
    name = f"n{num_envs}-s{skip_n}-o{int(overlap)}-p{int(plain)}-u{int(unroll)}-r{pool}"
    pool_size = None
    if plain:
        run_ppo(PPOConfig(**common, run_name=name, updates_per_chunk=1))
    else:
        hcfg = PPOHiddenConfig(**common, run_name=name, skip_n=skip_n, overlap=overlap, updates_per_chunk=1,
                               layer=layer, overlap_env_sms=env_sms,
                               reset_pool_size=None if pool == "auto" else int(pool))
        pool_size = hcfg.pool_size if skip_n else None
        run_hidden(hcfg, engine=engine)
    recs = [json.loads(l) for l in (Path(runs_dir) / name / "metrics.jsonl").read_text().splitlines()]
    steady = recs[1:] if len(recs) > 1 else recs  # the first update compiles

    def med(k):
        vals = [r[k] for r in steady if k in r]
        return statistics.median(vals) if vals else None

    return {
        "system": "ppo" if plain else "ppo-hidden", "num_envs": num_envs, "num_steps": num_steps, "unroll_env_scans": unroll,
        "skip_n": "never" if (plain or skip_n == 0) else skip_n, "overlap": overlap,
        "overlap_env_sms": env_sms if (overlap and not plain) else None,
        "sps_steady": med("sps"), "t_llm_s": med("timing/llm"), "t_env_s": med("timing/env_policy"),
        "t_render_s": med("timing/render"), "t_update_s": med("timing/update"), "t_norm_s": med("timing/norm"),
        "t_other_s": med("timing/other"), "update_wall_s": med("timing/update_wall"), "t_llm_wait_s": med("timing/llm_wait"),
        "llm_share": med("llm/share"), "prompt_suffix_tokens": med("llm/prompt_suffix_tokens"),
        # every update's (the first's too: early training is where most envs reset inside a window)
        "valid_frac": statistics.mean(r["hidden/valid_frac"] for r in recs) if "hidden/valid_frac" in recs[0] else None,
        "pool_draws_per_world": med("hidden/pool_draws_per_world"),
        "reset_pool_size": None if (plain or skip_n == 0) else pool, "pool_size": pool_size,
        "updates_measured": len(steady),
        "sps_per_update": [round(r["sps"], 1) for r in recs],  # the first one includes compiles
        "t_env_per_update": [round(r["timing/env_policy"], 4) for r in recs if "timing/env_policy" in r],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--num-envs", type=int, nargs="+", default=[128])
    ap.add_argument("--skip-n", type=int, nargs="+", default=[0, 100, 25, 5, 1], help="0 = never")
    ap.add_argument("--overlap", choices=["off", "on", "both"], default="both")
    ap.add_argument("--num-steps", type=int, default=100)
    ap.add_argument("--updates", type=int, default=4, help="updates per config (the first is not timed)")
    ap.add_argument("--updates-skip1", type=int, default=3, help="updates for skip_n=1 (slow)")
    ap.add_argument("--env", default=None)
    ap.add_argument("--layer", type=int, default=-1, help="LLM layer read (-1 = last; a middle layer costs less)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain PPO reference run")
    ap.add_argument("--overlap-env-sms", type=int, nargs="+", default=[16],
                    help="with overlap on one GPU: SMs kept free of LLM work (0 = no green-context partition); "
                         "several values: one overlap run each")
    ap.add_argument("--quantize", choices=["none", "fp8"], default="none", help="LLM decoder matmuls in FP8 (hf engine)")
    ap.add_argument("--skip1-overlap", action="store_true", help="also run skip_n=1 with overlap (off by default: slow)")
    ap.add_argument("--llm-layers", type=int, default=None,
                    help="cut the Qwen3-4B-shaped model to this many layers (a near-free LLM: isolates the loop's own costs)")
    ap.add_argument("--llm-device", default="cuda:0", help="torch device of the LLM (cuda:1: a second GPU; JAX uses the first, cuda:0; named: torch's \"cuda\" is the current GPU, which JAX's start may leave on the last one)")
    ap.add_argument("--unroll-env-scans", choices=["off", "on", "both"], default="on",
                    help="craftax's inner loops unrolled (PPOConfig.unroll_env_scans; its default auto = on on a GPU); both = each config twice")
    ap.add_argument("--reset-pool-size", nargs="+", default=["auto"],
                    help="ppo-hidden's reset pool per refresh (auto = num_envs / optimistic reset ratio; 0 = the old "
                         "masked scheme); several values: each config once per value (before/after: auto 0)")
    ap.add_argument("--run-tag", default=None,
                    help="stored as 'run' and part of the merge key: rows of a tagged run are kept beside earlier ones")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ppo_hidden_sps.json"))
    args = ap.parse_args()

    from thinkcraft.llm.protocol import Batch
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, make_prompt_prefix
    from thinkcraft.utils.jaxcache import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/thinkcraft-jax-cache"))
    env_name = args.env or ("Craftax-Classic-Symbolic-v1" if args.quick else "Craftax-Symbolic-v1")
    if args.quick:
        args.num_envs, args.num_steps, args.updates, args.updates_skip1 = [4], 8, 2, 2
        args.skip_n = [0, 8, 4]
    engine, model_desc = build_engine(args.quick, args.llm_device, args.quantize, args.llm_layers)
    if args.llm_device not in ("cuda", "cuda:0"):
        model_desc += f" on {args.llm_device}"
    runs_dir = tempfile.mkdtemp(prefix="tc-bench-")
    records: list[dict] = []
    overlaps = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    unrolls = {"off": [False], "on": [True], "both": [False, True]}[args.unroll_env_scans]
    for n in args.num_envs:
        tokens, rate = prefill_rate(engine, env_name, n)
        prefix_ids, _ = engine.tokenize_batch(Batch([""], prefix=make_prompt_prefix(PPOHiddenConfig())))
        _, rate_prefix = prefill_rate(engine, env_name, n, prefix_ids)
        print(f"[{n} envs] compact suffix {tokens:.1f} tokens/env, raw prefill {rate:,.0f} tok/s "
              f"→ LLM-bound limit at skip_n=1: {rate / tokens:,.0f} SPS; after the {len(prefix_ids)}-token "
              f"instructions (cascade): {rate_prefix:,.0f} tok/s", flush=True)
        base = {"sps_steady": None}
        for unroll in unrolls:
            if not args.no_plain:
                base = run_one(engine, env_name, n, args.num_steps, 0, False, args.updates, runs_dir, plain=True, unroll=unroll)
                records.append(base)
            for s in args.skip_n:
                runs = [(ov, sms, pool) for ov in ([False] if s == 0 or (s == 1 and not args.skip1_overlap) else overlaps)
                        for sms in (args.overlap_env_sms if ov else [16])
                        for pool in (["auto"] if s == 0 else args.reset_pool_size)]
                for ov, sms, pool in runs:
                    u = args.updates_skip1 if s == 1 else args.updates
                    r = run_one(engine, env_name, n, args.num_steps, s, ov, u, runs_dir, layer=args.layer, env_sms=sms,
                                unroll=unroll, pool=pool)
                    if s == 1:
                        # the limit of the definition: prefill rate / suffix tokens per env of the run's own texts
                        r["llm_bound_sps"] = rate / (r["prompt_suffix_tokens"] or tokens)
                        r["ratio_to_llm_bound"] = r["sps_steady"] / r["llm_bound_sps"]
                    records.append(r)
                    print_table(records[-1:], ["system", "num_envs", "skip_n", "overlap", "pool_size", "sps_steady",
                                               "valid_frac", "t_llm_s", "t_env_s", "t_render_s", "t_update_s", "t_other_s"])
                    for x in records:  # saved after every config: a time limit keeps what was measured
                        x.setdefault("prefill_tok_per_s", rate)
                        x.setdefault("prefill_after_prefix_tok_per_s", rate_prefix)
                        x.setdefault("ratio_to_plain_ppo", x["sps_steady"] / base["sps_steady"] if base["sps_steady"] else None)
                        x.update({"env": env_name, "llm": model_desc, "xla_flags": os.environ.get("XLA_FLAGS", ""), "layer": args.layer, "card": card(), "date": today(),
                                  "llm_device": args.llm_device, "quantize": args.quantize, "run": args.run_tag})
                    write_records(args.out, records, merge_keys=("system", "env", "llm", "num_envs", "skip_n", "overlap", "layer", "card",
                                                                 "llm_device", "overlap_env_sms", "quantize", "unroll_env_scans",
                                                                 "reset_pool_size", "run"))
    print()
    print_table(records, ["system", "num_envs", "skip_n", "overlap", "pool_size", "sps_steady", "ratio_to_plain_ppo",
                          "valid_frac", "t_llm_s", "t_env_s", "t_update_s", "prompt_suffix_tokens", "card"])


if __name__ == "__main__":
    main()
