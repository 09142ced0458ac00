"""How far from the exact adapter's policy does the engine sample, with LoRA merged into bf16 weights rounded to nearest,
merged with stochastic rounding (llm/hf/lora_fast.py `stochastic_bf16`), or unmerged (the base GEMM + the bf16 adapter
path)? Issue 19: merged weights take ~0.3 ms off each decode iteration (H200, BENCHMARKS §7b) and were opt-in for the
rounding; the question is whether that rounding biases the sampler away from what the learner trains.

    python bench/probes/merge_rounding_probe.py                  # bundled SmolLM2-135M-Instruct, CPU, ~1 min
    python bench/probes/merge_rounding_probe.py --model tiny     # a tiny random model (seconds)

For LoRA adapters (rank 16, alpha 32, every linear: `train llm-policy`'s defaults) whose update `s·B·A` has an RMS of
`--delta-rel` times the base weights' (1e-4: far below half a bf16 step, as after a few learner steps; 1e-2: above it),
the next-token distributions at every position of a few prompts, against the exact policy (fp32 weights W + s·B·A, fp32
compute). Two numbers a variant: how much of the adapter's effect on the log-probs it carries - its log-probs' change
from the bf16 base model's, projected on the exact change (fp32 adapter model less fp32 base): 1 all of it, 0 none,
the bias a rounding adds - and the mean KL(exact || variant), which also counts the bf16 compute's own noise (the
floor every bf16 path shares: the bf16 base model's KL at a tiny adapter). Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

PROMPTS = (
    "You play Craftax. Floor 0, day, facing grass. tree (-1,0) (2,3); water (0,4). Inventory: wood 2. "
    "Health 9, food 7, drink 6, energy 8. Choose one action.",
    "Question: a farmer has 17 sheep and buys 26 more, then sells 9. How many sheep does the farmer have now? "
    "Think step by step and end with #### and the number.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the window, wondering why anyone "
    "would run so fast on such a warm afternoon.",
)


def _model(name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":
        from thinkcraft.llm.testing import tiny_llama

        model, tok = tiny_llama(seed=0)
        return model.float(), tok
    from thinkcraft.llm.models import resolve_model

    path = resolve_model(name)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), AutoTokenizer.from_pretrained(str(path))


def _lora(model, delta_rel: float, seed: int):
    """`model` (fp32) with PEFT LoRA r=16, alpha=32 on every linear, B drawn so each layer's s·B·A has an RMS of
    `delta_rel` times its base weight's."""
    import peft
    import torch

    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                                      target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=gen))
                d = m.scaling["default"] * (b @ a)
                b.mul_(delta_rel * m.base_layer.weight.pow(2).mean().sqrt() / d.pow(2).mean().sqrt())
    return lora


def _exact(lora):
    """The exact policy: an fp32 copy with every adapter merged in fp32."""
    return copy.deepcopy(lora).merge_and_unload()


def _logprobs(model, ids):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


def _kl(p_log, q_log) -> float:
    """Mean over positions of KL(p || q) (natural log)."""
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (bundled SmolLM2-135M-Instruct) or tiny")
    ap.add_argument("--delta-rel", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    ap.add_argument("--draws", type=int, default=4, help="stochastic roundings measured per size (each re-merge draws anew)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "merge_rounding_probe.json"))
    a = ap.parse_args()
    if any(d <= 0 for d in a.delta_rel) or a.draws < 1:
        ap.error("--delta-rel values must be > 0 and --draws >= 1")
    import os

    import torch

    from thinkcraft.llm.hf import lora_fast

    torch.manual_seed(a.seed)
    base32, tok = _model(a.model)
    ids = [torch.tensor([tok(p, add_special_tokens=False)["input_ids"][:96]]) for p in PROMPTS]
    base16 = copy.deepcopy(base32).to(torch.bfloat16)
    base32 = copy.deepcopy(base16).float()  # a bf16 base, as the learner's is: its weights bf16 values exactly
    rows = []
    for delta in a.delta_rel:
        lora = _lora(base32, delta, a.seed)
        exact = _exact(lora)
        want = [_logprobs(exact, x) for x in ids]
        # the adapter's own effect on the log-probs, exactly (fp32 both), and the bf16 base model's log-probs: a
        # variant's effect is its log-probs less the bf16 base's (the compute's own rounding then mostly cancels)
        effect = torch.cat([(w - _logprobs(base32, x)).flatten() for w, x in zip(want, ids)])
        plain16 = [_logprobs(base16, x) for x in ids]
        kl_base = statistics.mean(_kl(w, b) for w, b in zip(want, plain16))
        bf16 = copy.deepcopy(lora).to(torch.bfloat16)

        def measured(merge: bool, rounding: str) -> tuple[float, float]:
            """(mean KL(exact || variant), the share of the adapter's effect the variant's log-probs carry: their
            change from the bf16 base model projected on the exact effect)."""
            os.environ["THINKCRAFT_LORA_MERGE_ROUNDING"] = rounding
            lora_fast.install(bf16, merge=merge)
            got = [_logprobs(bf16, x) for x in ids]
            moved = torch.cat([(g - b).flatten() for g, b in zip(got, plain16)])
            return (statistics.mean(_kl(w, g) for w, g in zip(want, got)),
                    float(moved.double() @ effect.double() / (effect.double() @ effect.double())))

        unmerged = measured(False, "nearest")
        nearest = measured(True, "nearest")
        stochastic = []
        for _ in range(a.draws):
            lora_fast.install(bf16, merge=False)  # the next install re-merges (a new draw)
            stochastic.append(measured(True, "stochastic"))
        lora_fast.strip(bf16)
        row = {"delta_rel": delta, "kl_base": kl_base, "kl_unmerged": unmerged[0], "kl_merged_nearest": nearest[0],
               "kl_merged_stochastic": statistics.mean(k for k, _ in stochastic),
               "captured_unmerged": unmerged[1], "captured_merged_nearest": nearest[1],
               "captured_merged_stochastic": statistics.mean(c for _, c in stochastic),
               "captured_merged_stochastic_draws": [c for _, c in stochastic]}
        rows.append(row)
        print(f"delta_rel {delta:g}: the adapter's effect carried (1 = all): unmerged {unmerged[1]:.3f}, merged "
              f"nearest {nearest[1]:.3f}, merged stochastic {row['captured_merged_stochastic']:.3f} (draws "
              f"{', '.join(f'{c:.3f}' for _, c in stochastic)}); KL(exact || .): bf16 base {kl_base:.3g}, unmerged "
              f"{unmerged[0]:.3g}, nearest {nearest[0]:.3g}, stochastic {row['kl_merged_stochastic']:.3g}", flush=True)
    os.environ.pop("THINKCRAFT_LORA_MERGE_ROUNDING", None)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "rank": 16, "alpha": 32, "tokens": [x.shape[1] for x in ids],
                                       "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
