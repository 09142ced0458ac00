"""Learner -> Ray engine actor weight sync, seconds per update (issue 21's goal: <= 0.5 s for 0.5B bf16 on
NVLink), through the pieces `--pool-backend ray` uses (pools/ray_weights.py, pools/ray_backend._EngineActor):

    object_store  ray.put of the CPU state (exact fp32), the actor loads it (sha256 checked on both sides)
    nccl          learner on cuda:0 (rank 0) -> one engine actor on another GPU: bf16 buckets of --bucket-mb
                  (bucket fingerprints checked on both sides); needs 2 GPUs

Model: the Qwen2.5-0.5B body (`random:qwen2.5-0.5b`, the TRL comparison shape), full fine-tuning (every
parameter) and LoRA r=16 (the adapters only). `snapshot_s` is the learner's copy of its state for the update
(async_build.weight_update: a CPU copy for the object store, a device copy for NCCL); `sync_s` the transfer
and load (median of --repeats after one warm-up).

    python bench/ray_weight_sync.py --quick        # CPU: tiny model, object store (plumbing; seconds)
    # GPU (2 cards; Ray carried as in BENCHMARKS.md "Ray on the GPU machine"):
    source bench/gpu_env.sh && source bench/carry_ray.sh install && python3 bench/ray_weight_sync.py

Writes bench/results/ray_weight_sync.json rows {shape, finetune, transport, bucket_mb, tensors, mb,
snapshot_s, sync_s, card, date} (merged by shape/finetune/transport/bucket_mb).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import card, print_table, today, write_records  # noqa: E402


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--finetune", default="full,lora")
    p.add_argument("--transports", default="auto", help="object_store,nccl (auto: nccl too with 2 GPUs)")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repeats (CPU plumbing check)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "ray_weight_sync.json"))
    return p.parse_args(argv)


def _policy(shape: str, finetune: str, device):
    """(cfg, model, tokenizer) as the trainer loads them (LoRA on a GPU: a bf16 base, fp32 adapters)."""
    import torch

    from thinkcraft.train.llm_policy.config import LLMPolicyConfig
    from thinkcraft.train.llm_policy.model import load_policy

    cfg = LLMPolicyConfig(model=f"random:{shape}", finetune=finetune, lora_rank=16, lora_alpha=32)
    dtype = torch.bfloat16 if device.type == "cuda" and finetune == "lora" else torch.float32
    model, tok = load_policy(cfg, ["What is 12 + 30? #### 42"] * 20, device, dtype)
    return cfg, model, tok


def measure(shape: str, finetune: str, transport: str, bucket_mb: float, repeats: int) -> dict:
    import copy

    import ray
    import torch

    from thinkcraft.pools import ray_backend as RB
    from thinkcraft.pools import ray_weights as RW
    from thinkcraft.pools.weights import WeightUpdate, trainable_state
    from thinkcraft.train.llm_policy.model import make_engine

    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    cfg, model, tok = _policy(shape, finetune, device)
    lora = finetune == "lora"
    remote = ray.remote(RB._EngineActor)
    handle = RB.ActorHandle("engine0", lambda n: remote.options(num_cpus=1, num_gpus=1 if cuda else 0).remote(
        copy.deepcopy(model).to("cpu"), functools.partial(make_engine, tokenizer=tok, cfg=cfg), lambda: None, 0, 1,
        cuda))
    engine = RB.RayEngine(handle, 600.0)
    RB.wait_ready([handle], "ready", 600)
    if transport == "nccl":
        sync = RW.NcclWeights(0, RW.NcclBroadcast(lambda: [engine], device, bucket_mb))
    else:
        sync = RW.ObjectStoreWeights(engine, RW._StoreCache())
    snaps, syncs = [], []
    for v in range(1, repeats + 2):
        with torch.no_grad():  # a new version: every published tensor changes a little
            for p in model.parameters():
                if p.requires_grad or not lora:
                    p.add_(1e-3)
        t0 = time.perf_counter()
        state = trainable_state(model, lora, device=None if transport == "nccl" else "cpu")
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        sync.apply(WeightUpdate(v, state, "lora" if lora else "full"))
        t2 = time.perf_counter()
        if v > 1:  # the first pays the group's set-up and the allocator's warm-up
            snaps.append(t1 - t0)
            syncs.append(t2 - t1)
    assert sync.version == repeats + 1
    handle.kill()
    return {"shape": shape, "finetune": finetune, "transport": transport,
            "bucket_mb": bucket_mb if transport == "nccl" else None, "tensors": len(state),
            "mb": round(sum(t.numel() * t.element_size() for t in state.values()) / 2 ** 20, 1),
            "snapshot_s": round(statistics.median(snaps), 4), "sync_s": round(statistics.median(syncs), 4),
            "card": card(), "date": today()}


def main(argv=None) -> None:
    import torch

    from thinkcraft.pools.ray_backend import connect

    a = _args(argv)
    if a.quick:
        a.shape, a.repeats = "tiny", 2
    transports = (["object_store"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])
                  if a.transports == "auto" else a.transports.split(","))
    connect("", hide_device="cuda:0" if torch.cuda.is_available() else None, num_cpus=4)
    rows = [measure(a.shape, ft, tr, a.bucket_mb, a.repeats) for ft in a.finetune.split(",") for tr in transports]
    print_table(rows, ["shape", "finetune", "transport", "bucket_mb", "tensors", "mb", "snapshot_s", "sync_s", "card"])
    if not a.quick:
        print("wrote", write_records(a.out, rows, merge_keys=("shape", "finetune", "transport", "bucket_mb")))


if __name__ == "__main__":
    main()
