"""What would FP8 (and fused projections) buy the hidden-state prefill? GEMM timings at Qwen3-4B's shapes.

    python bench/probes/fp8_probe.py                  # GPU only; M = tokens per refresh (128 envs x ~100-128)

For one decoder layer's projections at M tokens: bf16 as HF runs them (q, k, v, o, gate, up, down: seven
GEMMs), bf16 with q|k|v and gate|up fused (four GEMMs), and FP8 e4m3 with the same fusion through
`torch._scaled_mm` (row-wise scales: one per token, one per output channel), counting the activation
quantisation (amax, scale, cast) as part of the FP8 time. CUDA-event timing, median of 20 after warm-up.
Writes bench/results/fp8_probe.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (common.py)
from common import card, cuda_timed as timed, today, write_records  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="12800,16384")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "fp8_probe.json"))
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("fp8_probe needs a CUDA GPU")
    dev = "cuda"
    H, Q, KV, I = 2560, 4096, 1024, 9728  # Qwen3-4B
    f8 = torch.float8_e4m3fn

    def w(n_out: int, n_in: int) -> torch.Tensor:
        return torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) * n_in**-0.5

    sep = {"q": w(Q, H), "k": w(KV, H), "v": w(KV, H), "o": w(H, Q), "gate": w(I, H), "up": w(I, H), "down": w(H, I)}
    fused = {"qkv": torch.cat([sep["q"], sep["k"], sep["v"]]), "o": sep["o"],
             "gate_up": torch.cat([sep["gate"], sep["up"]]), "down": sep["down"]}
    ins = {"qkv": H, "o": Q, "gate_up": H, "down": I}

    def quant_w(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
        return (t.float() / s).to(f8), s.t().contiguous()  # (N, K) fp8 and (1, N) scales

    fp8w = {k: quant_w(v) for k, v in fused.items()}

    def quant_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
        return (x.float() / s).to(f8), s

    quant_x_c = torch.compile(quant_x)
    recs = []
    for m in [int(t) for t in a.tokens.split(",")]:
        xs = {k: torch.randn(m, n, device=dev, dtype=torch.bfloat16) for k, n in ins.items()}
        flops = 2 * m * sum(v.shape[0] * v.shape[1] for v in sep.values())

        def bf16_sep() -> None:
            for name, wt in sep.items():
                src = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}
                xs[src[name]] @ wt.t()

        def bf16_fused() -> None:
            for name, wt in fused.items():
                xs[name] @ wt.t()

        xq = {k: quant_x(x) for k, x in xs.items()}

        def fp8_gemm_only() -> None:
            for name, (wq, ws) in fp8w.items():
                torch._scaled_mm(xq[name][0], wq.t(), scale_a=xq[name][1], scale_b=ws, out_dtype=torch.bfloat16)

        def fp8_with_quant() -> None:
            for name, (wq, ws) in fp8w.items():
                q, s = quant_x_c(xs[name])
                torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16)

        rec = {"tokens": m, "card": card(), "date": today(), "layer_gflop": flops / 1e9}
        for name, fn in [("bf16_separate", bf16_sep), ("bf16_fused", bf16_fused), ("fp8_gemm_only", fp8_gemm_only),
                         ("fp8_with_quant", fp8_with_quant)]:
            try:
                t = timed(fn)
                rec[f"{name}_ms"] = t * 1e3
                rec[f"{name}_tflops"] = flops / t / 1e12
            except Exception as e:  # noqa: BLE001 - _scaled_mm signature / rowwise support varies by torch
                rec[f"{name}_error"] = repr(e)[:300]
        # accuracy of the fp8 layer output vs bf16 (relative error of one projection)
        ref = xs["gate_up"].float() @ fused["gate_up"].float().t()
        try:
            q, s = quant_x(xs["gate_up"])
            out = torch._scaled_mm(q, fp8w["gate_up"][0].t(), scale_a=s, scale_b=fp8w["gate_up"][1],
                                   out_dtype=torch.bfloat16).float()
            rec["fp8_rel_err"] = ((out - ref).norm() / ref.norm()).item()
        except Exception as e:  # noqa: BLE001
            rec["fp8_rel_err_error"] = repr(e)[:300]
        print(rec, flush=True)
        recs.append(rec)
    write_records(a.out, recs, merge_keys=("tokens", "card"))


if __name__ == "__main__":
    main()
