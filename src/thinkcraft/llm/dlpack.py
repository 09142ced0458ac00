"""torch <-> JAX through DLPack: no copy when both live on the same GPU; on CPU JAX may copy (its CPU
buffers need their own alignment), which is cheap at (N, H) hidden-state sizes.

Used to hand `HFEngine.hidden_states_torch(...)` to the JAX policy without a host round trip.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_to_jax(t: torch.Tensor) -> Any:
    """A jax.Array viewing (GPU) or copying (CPU) the torch tensor. The tensor is made contiguous first
    (DLPack needs a strided layout JAX accepts); autograd history is dropped."""
    import jax.dlpack

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type == "cuda":
        # JAX reads the buffer on its own stream: make sure torch's pending writes are finished.
        torch.cuda.current_stream(t.device).synchronize()
    return jax.dlpack.from_dlpack(t)


def jax_to_torch(x: Any) -> torch.Tensor:
    """A torch tensor viewing (GPU) or copying (CPU) the jax.Array."""
    x.block_until_ready()
    return torch.from_dlpack(x)


def shares_memory(t: torch.Tensor, x: Any) -> bool:
    """True when the torch tensor and the jax array use the same device buffer (zero-copy)."""
    try:
        ptr = x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - sharded / deleted arrays have no single pointer
        return False
    return int(ptr) == int(t.data_ptr())
