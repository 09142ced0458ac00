"""GRPO on `arith`: evidence that llm-policy learns, and its speed against TRL's GRPOTrainer.

    .venv/bin/python bench/grpo_arith.py                      # bundled SmolLM2-135M-Instruct, 30 steps (reward curve)
    .venv/bin/python bench/grpo_arith.py --quick              # CPU smoke run (2 steps, tiny batch)
    # GPU speed, same shape as the TRL reference (ANCHORS.md): Qwen2.5-0.5B body, random weights,
    # a 2,048-token byte-level BPE trained on the prompts, 16 prompts x 4 samples, <= 1,024 new tokens
    .venv/bin/python bench/grpo_arith.py --model-shape qwen2.5-0.5b --prompts 16 --samples 4 \
        --max-new-tokens 1024 --steps 5 [--kv-cache static --compile-decode]
    .venv/bin/python bench/grpo_arith.py --model-shape qwen2.5-0.5b ... --trl   # TRL GRPOTrainer, same shape

Reward: `#### <number>` exact match (1.0) + a format bonus (0.1 by default) for a `#### <number>` line.
Writes bench/results/grpo_arith<suffix>.json: {"summary": {...}, "steps": [{step, reward_mean,
seconds_per_step, samples_per_s, ...}]} and copies the run's curve PNG beside it. The summary's steady
numbers leave out the first step (it pays compiles and allocator warm-up). Compare TRL and ours only
from the same machine (run both in one GPU session).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import card, print_table, today  # noqa: E402


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="policy model (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-shape", default=None, help="random weights in a named shape (qwen2.5-0.5b, tiny)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--lr", type=float, default=None, help="default: 2e-4 LoRA, 1e-6 full")
    p.add_argument("--finetune", choices=["lora", "full"], default=None,
                   help="default: full for --model-shape (as TRL's reference), lora otherwise")
    p.add_argument("--format-weight", type=float, default=0.1)
    p.add_argument("--lenient-answer", action="store_true", help="grade the last number when there is no #### line")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--kv-cache", choices=["dynamic", "static"], default="dynamic")
    p.add_argument("--compile-decode", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: 2 steps, 2 prompts x 4, 16 tokens")
    p.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer at the same shape instead")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/grpo_arith[_<mode>].json)")
    p.add_argument("--run-dir", default=None, help="keep the run here (default: a temp dir)")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.prompts, a.samples, a.max_new_tokens = min(a.steps, 2), 2, 4, 16
    if a.finetune is None:
        a.finetune = "full" if a.model_shape else "lora"
    if a.lr is None:
        a.lr = 2e-4 if a.finetune == "lora" else 1e-6
    return a


def _config(a, run_dir: str):
    from thinkcraft.train.llm_policy import LLMPolicyConfig

    model = f"random:{a.model_shape}" if a.model_shape else a.model
    return LLMPolicyConfig(
        env="arith", algo="grpo", model=model, run_dir=run_dir, steps=a.steps, prompts_per_step=a.prompts,
        group_size=a.samples, max_new_tokens=a.max_new_tokens, difficulty=a.difficulty, lr=a.lr,
        finetune=a.finetune, format_weight=a.format_weight, lenient_answer=a.lenient_answer, micro_batch_size=a.micro_batch_size,
        kv_cache=a.kv_cache, compile_decode=a.compile_decode, seed=a.seed, checkpoint_every=0,
        store=True, plot=True, kl_coef=0.0, log_every_s=0.0,
    )


def _summary(steps: list[dict], batch: int) -> dict:
    steady = steps[1:] or steps
    s_per_step = statistics.median(r["seconds_per_step"] for r in steady)
    k = max(1, min(5, len(steps) // 3))
    first = statistics.mean(r["reward_mean"] for r in steps[:k])
    last = statistics.mean(r["reward_mean"] for r in steps[-k:])
    return {
        "seconds_per_step_steady": s_per_step,
        "samples_per_s_steady": batch / s_per_step,
        "first_step_s": steps[0]["seconds_per_step"],
        "reward_mean_first": first,
        "reward_mean_last": last,
        "reward_window_steps": k,
        "completion_mean_tokens": statistics.mean(r.get("completion_mean_tokens", float("nan")) for r in steps),
    }


def run_ours(a) -> tuple[dict, list[dict], Path | None]:
    from thinkcraft.train.llm_policy import run
    from thinkcraft.utils.metrics import read_metrics

    run_dir = a.run_dir or tempfile.mkdtemp(prefix="grpo_arith-")
    cfg = _config(a, run_dir)
    run(cfg)
    steps = [
        {
            "step": r["step"], "reward_mean": r["reward/mean"], "seconds_per_step": r["timing/step"],
            "samples_per_s": r["perf/samples_per_s"], "correct_rate": r.get("reward/correct_rate"),
            "invalid_rate": r["format/invalid_rate"], "completion_mean_tokens": r["completion/mean_tokens"],
            "tokens_per_s": r["perf/tokens_per_s"], "generate_s": r.get("timing/generate"), "train_s": r.get("timing/train"),
        }
        for r in read_metrics(Path(run_dir) / "metrics.jsonl")
    ]
    png = Path(run_dir) / "curve.png"
    return {"impl": "thinkcraft", "model": cfg.model, "finetune": cfg.finetune}, steps, png if png.exists() else None


def run_trl(a) -> tuple[dict, list[dict], Path | None]:
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"--trl needs TRL and datasets (`pip install trl datasets`): {e}")
    import torch

    from thinkcraft.envs.textenvs import ArithTask, RuleReward
    from thinkcraft.envs.textenvs.base import Problem
    from thinkcraft.train import llm_policy as LP

    if not a.model_shape:
        raise SystemExit("--trl compares at a random-weight shape: pass --model-shape qwen2.5-0.5b")
    cfg = _config(a, tempfile.mkdtemp(prefix="grpo_arith_trl-"))
    env = LP.make_env_and_reward(cfg)
    tok = LP.train_bpe_tokenizer(LP._prompt_corpus(cfg, env))  # the same tokenizer and weights as ours
    model = LP.random_model(a.model_shape, tok, seed=cfg.seed)
    task = ArithTask(a.difficulty)
    n_rows = a.prompts * (a.steps + 2)
    rows = []
    for i in range(n_rows):
        p = task.problem(LP._seed_of(cfg, 1 + i // a.prompts, i % a.prompts))
        rows.append({"prompt": [{"role": "system", "content": task.instructions},
                                {"role": "user", "content": p.question}], "answer": p.answer})
    ds = Dataset.from_list(rows)
    rule = RuleReward(format_weight=a.format_weight, lenient=a.lenient_answer)

    def reward_fn(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [r.reward for r in rule([Problem("", x) for x in answer], texts)]

    wanted = dict(
        output_dir=cfg.run_dir, per_device_train_batch_size=a.prompts * a.samples, num_generations=a.samples,
        max_completion_length=a.max_new_tokens, bf16=torch.cuda.is_available(), beta=0.0, learning_rate=a.lr,
        max_steps=a.steps, logging_steps=1, report_to="none", save_strategy="no", temperature=1.0,
        gradient_accumulation_steps=1, seed=a.seed, use_vllm=False, shuffle_dataset=False,
        use_cpu=not torch.cuda.is_available(),
    )
    fields = GRPOConfig.__dataclass_fields__
    args = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})

    class Timer(TrainerCallback):
        def __init__(self):
            self.t = []
            self.t0 = None

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.t.append(time.perf_counter() - self.t0)

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    batch = a.prompts * a.samples
    steps = []
    for i, dt_s in enumerate(timer.t):
        h = logs[i] if i < len(logs) else {}
        steps.append({"step": i + 1, "reward_mean": h.get("reward", float("nan")), "seconds_per_step": dt_s,
                      "samples_per_s": batch / dt_s,
                      "completion_mean_tokens": h.get("completions/mean_length", float("nan"))})
    return {"impl": f"trl {trl.__version__} GRPOTrainer", "model": cfg.model, "finetune": "full"}, steps, None


def main(argv=None) -> int:
    a = _args(argv)
    import torch

    t0 = time.time()
    info, steps, png = run_trl(a) if a.trl else run_ours(a)
    batch = a.prompts * a.samples
    summary = {**info, **_summary(steps, batch), "prompts": a.prompts, "samples": a.samples,
               "max_new_tokens": a.max_new_tokens, "steps": len(steps), "lr": a.lr, "card": card(), "date": today(),
               "torch": torch.__version__, "wall_s": time.time() - t0, "kv_cache": a.kv_cache,
               "compile_decode": a.compile_decode}
    suffix = ("_trl" if a.trl else "") + ("_quick" if a.quick else "") + (f"_{a.model_shape}" if a.model_shape else "")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"grpo_arith{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "steps": steps}, indent=2) + "\n")
    if png is not None:
        shutil.copy(png, out.with_suffix(".png"))
    print_table(steps, ["step", "reward_mean", "seconds_per_step", "samples_per_s", "completion_mean_tokens"])
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
