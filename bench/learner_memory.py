"""The llm-policy learner alone: peak GPU memory and tokens/s of one update with a real vocabulary, packed vs
padded micro-batches, chunked vs full LM-head logits.

    # GPU (one H100; `source bench/gpu_env.sh` first on the device image): Qwen2.5-0.5B and Qwen3-4B shapes,
    # vocabulary 151,936 (random weights, synthetic token ids), 2,048 turns of 30-150 prompt + 32 completion
    # tokens (~250k tokens: 256 envs x 8 decisions), LoRA, every mode
    python bench/learner_memory.py --shapes qwen2.5-0.5b --micro-batch-tokens 8192 16384
    python bench/learner_memory.py --shapes qwen3-4b --micro-batch-tokens 4096 8192
    python bench/learner_memory.py --shapes qwen2.5-0.5b --modes packed/chunked      # the default learner only
    python bench/learner_memory.py --shapes qwen2.5-0.5b --modes packed/chunked --micro-batch-tokens 8192 32768 --profile 25
                                                      # where the learner's time goes (device busy share, top ops)
    python bench/learner_memory.py --quick                                            # CPU smoke run

Modes (`layout/logits`):
    packed/chunked   the learner's default: token-budget micro-batches packed into one sequence (varlen
                     attention), log-probs through the LM head in chunks at trained positions only
    packed/full      packed, but the full (tokens x vocabulary) logits of every position
    padded/chunked   rows padded to the micro-batch's longest, chunked head
    padded/full      padded rows and full logits
    old              the learner before packing: padded, full logits, 8 rows per micro-batch

Per mode and token budget (`old` ignores the budget): one warm-up update, then `--repeats` timed ones
(synchronised); `learner_s` is their median, `learner_tokens_per_s` = real (unpadded) tokens / learner_s, `peak_learner_gb` = torch.cuda.max_memory_allocated
over the timed updates (the model's weights included: `model_gb`). The optimizer step runs (the LoRA weights
move; timing does not depend on their values). A mode that runs out of memory is a row with its error.

Rows go to bench/results/llm_policy_craftax.json (`bench: "learner"`, merged by mode and card with the
end-to-end rows of bench/llm_policy_craftax.py), or llm_policy_craftax_quick.json with --quick.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import card, print_table, today, torch_profile, write_records  # noqa: E402

MODES = {  # name -> (pack, logits chunked, rows cap or None = the token budget alone)
    "packed/chunked": (True, True, None),
    "packed/full": (True, False, None),
    "padded/chunked": (False, True, None),
    "padded/full": (False, False, None),
    "old": (False, False, 8),
}
COLS = ["model_shape", "vocab_size", "mode", "micro_batch_tokens", "tokens", "micro_batches", "pad_frac", "learner_s", "learner_tokens_per_s",
        "peak_learner_gb", "model_gb", "device_busy_frac", "error"]
MERGE_KEYS = ("bench", "model_shape", "vocab_size", "finetune", "mode", "micro_batch_tokens", "rows", "tokens", "card",
              "learner_compile")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen3-4b"])
    p.add_argument("--vocab-size", type=int, default=0, help="0 = the shape's real vocabulary (config.REAL_VOCAB)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rows", type=int, default=2048, help="turns per update (256 envs x 8 decisions)")
    p.add_argument("--prompt-tokens", nargs=2, type=int, default=[30, 150], help="uniform range of prompt lengths")
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--micro-batch-tokens", nargs="+", type=int, default=[8192],
                   help="token budgets to measure (each mode but `old`, which takes 8 rows, once per budget)")
    p.add_argument("--logit-chunk-mib", type=float, default=256.0)
    p.add_argument("--finetune", default="lora", choices=["lora", "full"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--learner-compile", action="store_true",
                   help="torch.compile the packed decoder forward (LLMPolicyConfig.learner_compile; the warm-up "
                        "update compiles)")
    p.add_argument("--device", default="auto")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one update per mode: the top N ops by device time, and device_busy_frac")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shape, 4,096 ids, 16 short turns")
    p.add_argument("--out", default=None, help="default bench/results/llm_policy_craftax[_quick].json")
    a = p.parse_args(argv)
    if a.quick:
        a.shapes, a.vocab_size, a.rows, a.prompt_tokens, a.completion_tokens = ["tiny"], 4096, 16, [10, 40], 8
        a.micro_batch_tokens, a.repeats, a.device = [256], 1, "cpu"
    a.out = a.out or str(ROOT / "bench" / "results" / f"llm_policy_craftax{'_quick' if a.quick else ''}.json")
    return a


def synthetic_rows(a: argparse.Namespace, vocab: int, device: Any) -> Any:
    """`build_rows` of `a.rows` turns with random ids, prompt lengths uniform in a.prompt_tokens, a.completion_tokens
    sampled tokens each (engine log-probs a plausible -1 ± 0.5), advantages ±1."""
    import numpy as np

    from thinkcraft.train.llm_policy import TurnRecord, build_rows

    rng = np.random.default_rng(0)
    lo, hi = a.prompt_tokens
    c = a.completion_tokens
    turns = []
    for p in rng.integers(lo, hi + 1, a.rows).tolist():
        ids = rng.integers(0, vocab, p + c).tolist()
        turns.append(TurnRecord(obs="", prompt_ids=ids[:p], completion_ids=ids[p:],
                                logprobs=(-1.0 + 0.5 * rng.standard_normal(c)).tolist(), train_mask=[1] * c, text="",
                                finish_reason="length"))
    adv = rng.choice([-1.0, 1.0], a.rows).tolist()
    return build_rows(turns, adv, [0.0] * a.rows, 0, device)


def measure(a: argparse.Namespace, model: Any, rows: Any, mode: str, budget: int, device: Any, autocast: Any
            ) -> dict[str, Any]:
    import torch

    from thinkcraft.train.llm_policy import Learner, LLMPolicyConfig

    pack, chunked, max_rows = MODES[mode]
    cfg = LLMPolicyConfig(model="random:tiny", finetune=a.finetune, micro_batch_tokens=budget if max_rows is None
                          else 1 << 40, micro_batch_size=max_rows or 0, pack=pack,
                          logit_chunk_mib=a.logit_chunk_mib if chunked else 0.0, max_grad_norm=1.0,
                          learner_compile=a.learner_compile and pack)
    learner = Learner(cfg, model, None, device, autocast)
    cuda = device.type == "cuda"
    stats = learner.update(rows)  # warm-up: allocator, cuBLAS handles, the optimizer's state
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        stats = learner.update(rows)  # returns after reading its statistics back: the device is done
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    prof = profile_update(a, learner, rows, f"{mode}-{budget}") if a.profile else {}
    del learner
    s = statistics.median(times)
    return {"layout": "packed" if stats["learner/packed"] == 1.0 else "padded", "logits": "chunked" if chunked else "full",
            "micro_batches": int(stats["learner/micro_batches"]), "pad_frac": round(stats["learner/pad_frac"], 3),
            "learner_s": round(s, 3), "learner_tokens_per_s": round(stats["learner/tokens"] / s, 1),
            "peak_learner_gb": None if peak is None else round(peak, 2), **prof}


def profile_update(a: argparse.Namespace, learner: Any, rows: Any, tag: str) -> dict[str, Any]:
    """One more update under torch.profiler (`common.torch_profile`): the top `a.profile` ops by device time
    (printed, and written to <out's folder>/logs/learner_profile_<tag>.{txt,json}) and `device_busy_frac` =
    summed kernel time / wall time of the update (near 1: compute-bound, so faster kernels or fewer FLOPs help;
    well below 1: the host's launches and Python (PEFT wrappers, per-layer ops) leave the device idle, so larger
    micro-batches or CUDA graphs help)."""
    tag = tag.replace("/", "-")
    log = Path(a.out).resolve().parent / "logs" / f"learner_profile_{tag}"
    _, s = torch_profile(lambda: learner.update(rows), learner.device.type == "cuda", log, tag, top=a.profile,
                         show_table=True)
    shown = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log
    return {"profile_wall_s": s["wall_s"], "device_busy_frac": s["device_busy_frac"], "profile_log": f"{shown}.txt"}


def run_shape(a: argparse.Namespace, shape: str) -> list[dict[str, Any]]:
    import torch

    from thinkcraft.train.llm_policy import LLMPolicyConfig, random_model, trainable
    from thinkcraft.train.llm_policy.config import REAL_VOCAB
    from thinkcraft.train.llm_policy.model import _device

    device = _device(a.device)
    cuda = device.type == "cuda"
    autocast = torch.bfloat16 if cuda else None
    vocab = a.vocab_size or REAL_VOCAB[shape]
    model = random_model(shape, vocab_size=vocab, seed=0)
    base_dtype = torch.bfloat16 if (cuda and a.finetune == "lora") else torch.float32
    model = trainable(model.to(device=device, dtype=base_dtype), LLMPolicyConfig(finetune=a.finetune)).eval()
    model_gb = torch.cuda.memory_allocated() / 2**30 if cuda else None
    rows = synthetic_rows(a, vocab, device)
    tokens = int(rows.attention_mask.sum())
    base = {"bench": "learner", "model_shape": shape, "vocab_size": vocab, "finetune": a.finetune,
            "logit_chunk_mib": a.logit_chunk_mib, "rows": a.rows,
            "tokens": tokens, "completion_tokens": a.completion_tokens, "prompt_tokens": list(a.prompt_tokens),
            "model_gb": None if model_gb is None else round(model_gb, 2), "card": card(), "date": today(),
            "quick": a.quick}
    out = []
    runs = [(m, b) for b in a.micro_batch_tokens for m in a.modes if m != "old"]
    runs += [("old", None)] if "old" in a.modes else []
    for mode, budget in runs:
        head = {**base, "mode": mode, "micro_batch_tokens": budget, "micro_batch_rows": MODES[mode][2],
                "learner_compile": bool(a.learner_compile and MODES[mode][0]) or None}
        try:
            r = {**head, **measure(a, model, rows, mode, budget or 0, device, autocast)}
        except Exception as e:  # noqa: BLE001 - one mode running out of memory must not lose the others
            traceback.print_exc()
            r = {**head, "error": f"{type(e).__name__}: {e}"[:300]}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(f"  {shape} {mode} budget={budget}: " + (r.get("error") or f"{r['learner_s']} s, "
              f"{r['learner_tokens_per_s']:,.0f} tok/s, peak {r['peak_learner_gb']} GB"), flush=True)
        out.append(r)
    del model, rows
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    rows: list[dict[str, Any]] = []
    for shape in a.shapes:
        rows += run_shape(a, shape)
        write_records(a.out, rows, merge_keys=MERGE_KEYS)
    print_table(rows, COLS)
    print(f"wrote {a.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
