"""Can the LLM refresh and the env scan run at the same time on one GPU? A probe for ppo-hidden's --overlap.

    python bench/probes/overlap_probe.py                 # GPU: Qwen3-4B-shaped random LLM + Craftax-Symbolic, 128 envs
    python bench/probes/overlap_probe.py --env-only      # just the env window (compare XLA_FLAGS settings)
    python bench/probes/overlap_probe.py --quick         # CPU smoke run (tiny LLM, Classic, 4 envs)

Measures, each the median of a few repeats after warm-up:
  * env window alone: a jitted lax.scan of `--steps` random-action steps of `--num-envs` envs; the time for
    the jitted call to *return* (dispatch) and to finish — if dispatch ≈ finish, JAX runs the scan's
    host-driven loop on the calling thread and a single-threaded "overlap" cannot overlap anything;
  * LLM alone: one `hidden_states_torch` refresh of every env's compact text (shared prefix reused);
  * both at once, several ways: single thread (dispatch scan, then LLM), LLM in a worker thread on torch's
    current stream, on a side stream, on a high-priority side stream (and, where torch has it, with a
    cuBLAS SM carve-out that leaves SMs free for the env kernels), and on a CUDA green context that gives
    the LLM only `--green-sms` of the GPU's SMs (torch.cuda.green_contexts; the env keeps all of them).
Also prints the top CUDA kernels of one LLM refresh (torch profiler). Writes bench/results/overlap_probe.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (common.py)
from common import card, random_action_carry, random_action_window, today, write_records  # noqa: E402


def _med(f, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-envs", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100, help="env steps per window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--env-only", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layer", type=int, default=-1, help="hidden-state layer of the LLM refresh")
    ap.add_argument("--green-sms", default="96,112,120", help="SM counts to try for the LLM's green context")
    ap.add_argument("--tag", default="", help="label for this run (e.g. the XLA_FLAGS used)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "overlap_probe.json"))
    a = ap.parse_args()
    env_name = "Craftax-Classic-Symbolic-v1" if a.quick else "Craftax-Symbolic-v1"
    if a.quick:
        a.num_envs, a.steps, a.repeats = 4, 8, 2

    import jax

    from thinkcraft.envs.craftax import make_env
    from thinkcraft.utils.jaxcache import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/thinkcraft-jax-cache"))
    N, S = a.num_envs, a.steps
    env = make_env(env_name, N, min(16, N))

    window = random_action_window(env, S)
    carry = random_action_carry(env)
    t0 = time.perf_counter()
    carry = jax.block_until_ready(window(carry))
    compile_s = time.perf_counter() - t0
    carry = jax.block_until_ready(window(carry))  # weak-type retrace, if any

    holder = {"c": carry}

    def env_full():
        holder["c"] = jax.block_until_ready(window(holder["c"]))

    ts_dispatch = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        holder["c"] = window(holder["c"])
        ts_dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(holder["c"])
    dispatch_s = statistics.median(ts_dispatch)
    env_s = _med(env_full, a.repeats)
    rec = {"tag": a.tag or os.environ.get("XLA_FLAGS", "default"), "env": env_name, "num_envs": N, "steps": S,
           "env_compile_s": compile_s, "env_dispatch_return_s": dispatch_s, "env_window_s": env_s,
           "env_sps": N * S / env_s, "card": card(), "date": today()}
    print(json.dumps(rec), flush=True)
    if a.env_only:
        write_records(a.out, [rec], merge_keys=("tag", "env", "num_envs", "steps", "card"))
        return

    import torch

    from ppo_hidden_sps import build_engine
    from thinkcraft.envs.text import render_states
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, make_prompt_prefix

    engine, model_desc = build_engine(a.quick)
    texts = render_states(holder["c"][1], "compact")
    prefix_ids, items = engine.tokenize_batch(Batch(texts, prefix=make_prompt_prefix(PPOHiddenConfig())))
    cuda = torch.cuda.is_available()

    def llm(stream=None):
        ctx = torch.cuda.stream(stream) if (cuda and stream is not None) else contextlib.nullcontext()
        with ctx:
            h = engine.hidden_states_torch(Batch(items, prefix=prefix_ids), layer=a.layer)
            if cuda:
                torch.cuda.current_stream().synchronize()
        return h

    llm()
    llm_s = _med(llm, a.repeats)
    lens = sorted(map(len, items))
    rec.update({"layer": a.layer, "suffix_tokens_min": lens[0], "suffix_tokens_max": lens[-1],
                "suffix_padding_share": 1 - sum(lens) / (lens[-1] * len(lens))})
    rec.update({"llm": model_desc, "prefix_tokens": len(prefix_ids), "suffix_tokens_mean": sum(map(len, items)) / N,
                "llm_s": llm_s, "suffix_tok_per_s": sum(map(len, items)) / llm_s, "sum_s": env_s + llm_s,
                "max_s": max(env_s, llm_s)})

    def single_thread():
        holder["c"] = window(holder["c"])
        llm()
        jax.block_until_ready(holder["c"])

    def threaded(stream=None):
        def run():
            out["t_llm"] = _med(lambda: llm(stream), 1)

        out = {}
        th = threading.Thread(target=run)
        th.start()
        t0 = time.perf_counter()
        env_full()
        out["t_env"] = time.perf_counter() - t0
        th.join()
        return out

    modes = {"single_thread": lambda: single_thread()}
    if cuda:
        lo = torch.cuda.Stream()
        hi = torch.cuda.Stream(priority=-1)
        modes.update({"thread_current_stream": lambda: threaded(None), "thread_side_stream": lambda: threaded(lo),
                      "thread_side_stream_high_prio": lambda: threaded(hi)})
    else:
        modes["thread"] = lambda: threaded(None)
    for name, f in modes.items():
        f()
        rec[f"{name}_s"] = _med(f, a.repeats)
        print(name, f"{rec[f'{name}_s']:.3f} s  (sum {rec['sum_s']:.3f}, max {rec['max_s']:.3f})", flush=True)
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if cuda and carve is not None:
        for k in (8, 16, 32):
            try:
                carve(k)
                f = lambda: threaded(lo)  # noqa: E731
                f()
                rec[f"thread_side_stream_carveout{k}_s"] = _med(f, a.repeats)
                print(f"carveout {k}", f"{rec[f'thread_side_stream_carveout{k}_s']:.3f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - experimental API
                rec["carveout_error"] = repr(e)
                break
            finally:
                with contextlib.suppress(Exception):
                    carve(None)
        with contextlib.suppress(Exception):
            rec["llm_s_after_carveout_reset"] = _med(llm, a.repeats)
    gc = getattr(torch.cuda, "green_contexts", None)
    if cuda and gc is None:
        with contextlib.suppress(Exception):
            import torch.cuda.green_contexts as gc  # noqa: F811
    if cuda and gc is not None:
        rec["torch"] = torch.__version__
        for k in [int(x) for x in a.green_sms.split(",") if x]:
            for scope in (None, "balanced"):
                name = f"green{k}" + (f"_{scope}" if scope else "")
                try:
                    kw = {"num_sms": k, "device_id": torch.cuda.current_device()}
                    if scope:
                        kw["workqueue_scope"] = scope
                    g = gc.GreenContext.create(**kw)
                    gs = g.Stream()
                    llm(gs)
                    rec[f"llm_{name}_s"] = _med(lambda: llm(gs), a.repeats)
                    f = lambda: threaded(gs)  # noqa: E731
                    f()
                    rec[f"thread_{name}_s"] = _med(f, a.repeats)
                    print(name, f"llm alone {rec[f'llm_{name}_s']:.3f} s, with env {rec[f'thread_{name}_s']:.3f} s",
                          flush=True)
                except Exception as e:  # noqa: BLE001 - beta API, may be missing or refuse a count
                    rec[f"{name}_error"] = repr(e)[:300]
                    print(name, "failed:", repr(e)[:300], flush=True)
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
        print(table)
        (Path(a.out).parent / "overlap_probe_llm_kernels.txt").write_text(table)
    print(json.dumps(rec, indent=2))
    write_records(a.out, [rec], merge_keys=("tag", "env", "num_envs", "steps", "card"))


if __name__ == "__main__":
    main()
