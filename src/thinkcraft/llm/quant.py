"""FP8 (e4m3) weights and activations for a frozen model's decoder linears - the hidden-state prefill's
matmuls run on the FP8 tensor cores (Hopper/Ada): 1.5x the bf16 matmul rate measured (below).

Scaling is "dynamic per-token / per-channel": each weight row (output channel) has its own scale, fixed
when the model is quantised; each activation row (token) gets its scale from its own max at call time.
`torch._scaled_mm` (`compat.scaled_mm`) applies both scales in the matmul's epilogue. bench/fp8_probe.py measured, at
Qwen3-4B's layer shapes and 12,800 tokens on an H100: the layer's matmuls 3.35 ms (bf16) -> 2.19 ms
(FP8) -> 2.78 ms counting a stand-alone quantisation of the activations (inside the compiled prefill
layer the quantisation fuses into the preceding norm/activation kernel); one projection's relative error
vs fp32 3.7% on random data (the tests check a tiny model's hidden states stay within cosine 0.98 of the
unquantised ones). For a frozen feature extractor (ppo-hidden) where speed matters more than the last
digits, not for a model being trained. In the engine: prefill 64,212 -> 79,400-83,386 tok/s (BENCHMARKS §4).
"""

from __future__ import annotations

import torch
from torch import nn

from thinkcraft.llm.compat import scaled_mm
from thinkcraft.utils.errors import UserError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


class FP8Linear(nn.Module):
    """Drop-in for a frozen nn.Linear: weight as float8 e4m3 with one scale per output channel, the input
    quantised per row at call time, the product in the original dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        self.register_buffer("weight_fp8", (w.float() / scale).to(FP8).contiguous())  # (out, in), row-major
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, out)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = w.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        x_scale = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (M, 1)
        xq = (x2.float() / x_scale).to(FP8)
        # b must be column-major: the transpose of the row-major (out, in) weight is exactly that
        y = scaled_mm(xq, self.weight_fp8.t(), x_scale, self.weight_scale, self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"


def quantize_fp8_(layers: nn.Module) -> int:
    """Replace every nn.Linear inside `layers` (in place) by an FP8Linear; returns how many. Linears whose
    sizes are not multiples of 16 (FP8 matmul tiles) stay as they are."""
    todo = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear) and child.in_features % 16 == 0 and child.out_features % 16 == 0]
    for parent, name, child in todo:
        if child.weight.requires_grad:
            raise UserError("FP8 quantisation is for a frozen model: a decoder weight requires grad "
                            "(call model.requires_grad_(False), or do not quantise a model being trained)")
        setattr(parent, name, FP8Linear(child))
    return len(todo)


def check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise UserError(f"FP8 needs a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper); {name} has "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
