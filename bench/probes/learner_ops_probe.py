"""What do the llm-policy learner's elementwise operators cost at its micro-batch shape, and what would each
alternative save? (issue 19: the learner's 3.0 s a step caps end to end at ~670 decisions/s; its torch.profiler
view spent more device time in `aten::copy_` and `aten::mul` than in the matrix products)

Forward + backward, timed with CUDA events (the median of --repeats after a warm-up), over one (tokens, hidden)
bf16 activation that requires grad, as the learner's packed micro-batch feeds every layer:
  - rmsnorm: HF's Qwen2RMSNorm (fp32 upcast, five passes), `F.rms_norm` (one fused kernel where torch has one), and
    HF's forward through torch.compile (dynamic shapes; its compile time is printed).
  - lora: one adapted linear (hidden -> intermediate) as PEFT computes it under bf16 autocast (fp32 adapters: the
    activation cast to fp32 and back, a scale and a sum) and as `lora_fast._train_forward` does (no activation
    casts, the scale and sum in the GEMM's epilogue).

    PYTHONPATH=src python bench/probes/learner_ops_probe.py                 # GPU: 65,536 tokens, the 0.5B shape
    PYTHONPATH=src python bench/probes/learner_ops_probe.py --quick         # CPU: tiny, the plumbing only
Writes bench/results/learner_ops_probe.json (or --out).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import card, today  # noqa: E402


def _time_ms(fn, repeats: int, cuda: bool) -> float:
    fn()  # warm-up (and compile)
    out = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def _fwd_bwd(module_fn, x: torch.Tensor, grad: torch.Tensor):
    def run() -> None:
        x.grad = None
        y = module_fn(x)
        y.backward(grad)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the norms' activation and weight (float32: full fine-tuning's residual stream)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/learner_ops_probe.json")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.hidden, a.intermediate, a.rank, a.repeats = 64, 32, 64, 4, 2
    cuda = torch.cuda.is_available() and not a.quick
    dev = torch.device("cuda" if cuda else "cpu")
    dt = getattr(torch, a.dtype)
    torch.manual_seed(0)
    rows = []

    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(a.hidden, eps=1e-6).to(dev, dt).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(a.tokens, a.hidden, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn_like(x)
    fused = lambda t: F.rms_norm(t, (a.hidden,), norm.weight, 1e-6)  # noqa: E731
    t0 = time.perf_counter()
    compiled = torch.compile(norm.forward, dynamic=True)
    compiled(x).backward(g)
    compile_s = time.perf_counter() - t0
    ref = norm(x)
    err = {"fused": (fused(x) - ref).abs().max().item(), "compiled": (compiled(x) - ref).abs().max().item()}
    for name, fn in (("hf", norm), ("F.rms_norm", fused), ("compiled", compiled)):
        ms = _time_ms(_fwd_bwd(fn, x, g), a.repeats, cuda)
        rows.append({"op": "rmsnorm", "variant": name, "fwd_bwd_ms": round(ms, 4),
                     "max_abs_diff_vs_hf": None if name == "hf" else err["fused" if name == "F.rms_norm" else "compiled"],
                     "compile_s": round(compile_s, 1) if name == "compiled" else None})

    try:
        if dt != torch.bfloat16:
            raise ImportError("the LoRA rows are for a bf16 base")
        import peft

        from thinkcraft.llm import compat
        from thinkcraft.llm.hf import lora_fast
    except ImportError as e:
        print(f"lora rows skipped: {e}")
    else:
        base = torch.nn.Sequential(torch.nn.Linear(a.hidden, a.intermediate, bias=False)).to(dev, dt)
        model = peft.get_peft_model(base, peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=["0"]))
        with torch.no_grad():
            for n, prm in model.named_parameters():
                if "lora_B" in n:
                    prm.normal_(std=0.02)
        twin = copy.deepcopy(model)
        lora_fast.install_for_learner(model)
        gy = torch.randn(a.tokens, a.intermediate, device=dev, dtype=dt)
        ctx = (lambda: compat.autocast(dt)) if cuda else (lambda: torch.autocast("cpu", dtype=dt))
        for name, m in (("peft", twin), ("cast-free", model)):
            def fn(t, m=m):
                with ctx():
                    return m(t)
            ms = _time_ms(_fwd_bwd(fn, x, gy), a.repeats, cuda)
            rows.append({"op": "lora_linear", "variant": name, "fwd_bwd_ms": round(ms, 4),
                         "shape": [a.tokens, a.hidden, a.intermediate, a.rank]})

    meta = {"card": card(), "date": today(), "torch": torch.__version__, "tokens": a.tokens, "hidden": a.hidden,
            "dtype": a.dtype, "quick": a.quick}
    for r in rows:
        r.update(meta)
        print(json.dumps(r))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
