"""`utils.transfer.to_device`: the values arrive; on CUDA the host does not wait for queued device work."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from thinkcraft.utils.transfer import to_device


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.float32, bool])
def test_to_device_cpu_values_and_dtype(dtype):
    a = (np.arange(12).reshape(3, 4) % 3).astype(dtype)
    t = to_device(a, "cpu")
    assert t.dtype == torch.from_numpy(a).dtype and t.shape == (3, 4)
    assert np.array_equal(t.numpy(), a)


def test_to_device_takes_strided_arrays_and_tensors():
    a = np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2]  # not contiguous: from_numpy alone would keep strides
    assert np.array_equal(to_device(a, torch.device("cpu")).numpy(), a)
    t = torch.arange(5)
    assert torch.equal(to_device(t, "cpu"), t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_does_not_wait_for_queued_work():
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued on the current stream (at ~2 GHz)
    t0 = time.perf_counter()
    t = to_device(np.arange(256, dtype=np.int64), dev)
    host_s = time.perf_counter() - t0
    blocking_t0 = time.perf_counter()
    u = torch.from_numpy(np.arange(256, dtype=np.int64)).to(dev)  # the blocking copy: waits for the sleep
    blocking_s = time.perf_counter() - blocking_t0
    assert torch.equal(t.cpu(), u.cpu())
    assert host_s < 0.1 < blocking_s, (host_s, blocking_s)
