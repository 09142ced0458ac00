"""Run an engine's GPU work on a subset of the GPU's SMs (a CUDA green context), leaving the rest free.

Why: ppo-hidden's `--overlap` runs the LLM refresh while the env+policy scan steps. The env at 128 envs
is a long chain of tiny kernels; when the LLM's matmuls hold every SM, each env kernel queues behind
them and the two times add up (bench/overlap_probe.py: env 0.42 s + LLM 0.15 s -> 0.55-0.57 s together,
whatever the streams or priorities). With the LLM confined to all but 16 SMs, the env's kernels always
find free SMs: 0.46-0.47 s together, and the LLM alone is only ~7% slower (H100, same probe).
"""

from __future__ import annotations

from typing import Any

import torch

from thinkcraft.llm.compat import green_context
from thinkcraft.utils.errors import UserError


class SMPartition:
    """A green context of `sm_count` SMs on `device` and a stream in it. Work queued on `stream` runs
    only on those SMs; other streams (other libraries, e.g. JAX) still use the whole GPU."""

    def __init__(self, device: torch.device, sm_count: int) -> None:
        if device.type != "cuda":
            raise UserError(f"an SM limit needs a CUDA device, the engine is on {device}")
        total = torch.cuda.get_device_properties(device).multi_processor_count
        if not 1 <= sm_count < total:
            raise UserError(f"SM limit {sm_count} out of range: the GPU has {total} SMs (use 1..{total - 1})")
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            self._ctx, self.stream = green_context(sm_count, index)
        except ImportError:
            raise UserError(f"an SM limit needs torch.cuda.green_contexts (torch >= 2.10, CUDA >= 12.4); "
                            f"this torch is {torch.__version__}") from None
        except Exception as e:  # noqa: BLE001 - driver / runtime without green contexts
            raise UserError(f"could not create a CUDA green context of {sm_count} SMs on {device}: {e}") from e
        self.sm_count = sm_count
