"""Host arrays to a device without waiting for the device.

A plain `torch.from_numpy(a).to("cuda")` copies from pageable memory and then synchronises the stream (torch's
blocking host-to-device copy): the host waits for *all* work queued before it. In a decode loop that runs one
step ahead (the batcher launches step k+1, then reads step k's record), one such copy - a finished row's slot
index, a new row's state - made the host wait for the step in flight, so host and device stopped overlapping
whenever a row ended or joined. `to_device` stages the array in pinned memory (torch's caching host allocator
keeps the block until the copy has run) and copies asynchronously, in stream order with the work that reads it.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`a` (a numpy array or a CPU tensor) on `device`, without a host-device sync on CUDA. The result never
    shares memory with `a` on CUDA; on the CPU it may (as `Tensor.to`)."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
