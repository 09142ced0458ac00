"""Learner -> Ray engine actors: versioned weight sync through the object store or an NCCL broadcast group.

Both paths carry `WeightUpdate.state` (pools/weights.py: every parameter, or the LoRA adapters only) and
end in the actor's own `CopyWeights.apply` (atomic: every name and shape checked before any copy; an
update not newer than the actor's version is ignored). Each transfer is checked end to end: the sender's
checksum of what it sent must equal the receiver's checksum of what it got, and the actor reports the
version it holds afterwards; a mismatch raises, so the engine front keeps the old version and retries.

- Object store (`ObjectStoreWeights`, any device): `ray.put` of the CPU state once per version (shared by
  every engine slot: one copy in the store however many engines), exact tensors, sha256 over the bytes.
- NCCL (`NcclBroadcast` + `NcclWeights`, when the learner and the engines have CUDA): the learner (rank 0,
  the driver process) and every engine actor (ranks 1..K) form one torch `ProcessGroupNCCL` on a
  `TCPStore` (no global `init_process_group`: the learner's own process group, if any, is untouched, as
  OpenRLHF / verl do for their vLLM engines). Tensors go as bf16 in flat buckets of ~`bucket_mb`
  (`plan_buckets`, `pack_bucket`, `unpack_bucket`: few large broadcasts instead of one per tensor). One
  broadcast per version serves every engine; the group is rebuilt after an engine actor was replaced.

The bucketing and checksum helpers are pure functions (tests/test_pools_ray.py); the NCCL path itself needs
two GPUs (its test skips otherwise).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from thinkcraft.pools.weights import WeightUpdate

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    numel: int


def state_checksum(state: dict[str, Any], names: Sequence[str] | None = None) -> str:
    """sha256 over (name, shape, dtype, bytes) of `state`'s tensors in name order (`names`: a subset)."""
    import torch

    h = hashlib.sha256()
    for n in sorted(names if names is not None else state):
        t = state[n].detach().to("cpu").contiguous()
        h.update(f"{n}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tensor_metas(state: dict[str, Any]) -> list[TensorMeta]:
    """The state's tensors in name order (sender and receivers agree on it)."""
    return [TensorMeta(n, tuple(state[n].shape), int(state[n].numel())) for n in sorted(state)]


def plan_buckets(metas: Sequence[TensorMeta], elem_bytes: int, bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped greedily into buckets of at most `bucket_bytes` (a larger tensor goes
    alone): indices into `metas`. Every tensor appears exactly once, in order."""
    if bucket_bytes < 1 or elem_bytes < 1:
        raise ValueError("bucket_bytes and elem_bytes must be >= 1")
    buckets: list[list[int]] = []
    size = 0
    for i, m in enumerate(metas):
        b = m.numel * elem_bytes
        if not buckets or (size + b > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return buckets


def pack_bucket(tensors: Sequence[Any], dtype: Any, device: Any = None) -> Any:
    """One flat tensor of `dtype` (on `device`) holding the tensors one after the other."""
    import torch

    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])


def unpack_bucket(flat: Any, metas: Sequence[TensorMeta]) -> list[Any]:
    """Views into `flat`, one per meta (the inverse of `pack_bucket`)."""
    if sum(m.numel for m in metas) != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} elements for tensors of {sum(m.numel for m in metas)}")
    out, at = [], 0
    for m in metas:
        out.append(flat[at:at + m.numel].view(m.shape))
        at += m.numel
    return out


def bucket_fingerprint(flat: Any, chunk: int = 1 << 24) -> tuple[int, int]:
    """A position-sensitive fingerprint of a flat 16-bit bucket, computed where it lies (the GPU for NCCL:
    hashing the bytes on the CPU would cost more than the broadcast): (Σ v, Σ v·(i mod 8191 + 1)) over the
    raw 16-bit values v, in int64. Any single changed value, and any swap of two values at positions that
    differ mod 8191, changes it."""
    import torch

    bits = flat.reshape(-1).view(torch.int16)
    s1 = s2 = 0
    for a in range(0, bits.numel(), chunk):
        v = bits[a:a + chunk].to(torch.int32)
        w = (torch.arange(a, a + v.numel(), device=v.device, dtype=torch.int32) % 8191) + 1
        s1 += int(v.sum(dtype=torch.int64))
        s2 += int((v * w).sum(dtype=torch.int64))
    return s1, s2


def buckets_digest(prints: Sequence[tuple[int, int]]) -> str:
    return hashlib.sha256(repr(list(prints)).encode()).hexdigest()


def bf16_digest(state: dict[str, Any], bucket_bytes: int) -> str:
    """What `nccl_send` reports for `state` (the reference for tests and checks)."""
    import torch

    metas = tensor_metas(state)
    return buckets_digest([bucket_fingerprint(pack_bucket([state[metas[i].name] for i in idx], torch.bfloat16))
                           for idx in plan_buckets(metas, 2, bucket_bytes)])


# ------------------------------------------------------------------------------------- object store


class _StoreCache:
    """One `ray.put` per published update, shared by the engine slots (the newest kept; older refs released)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._ref: Any = None
        self._checksum = ""

    def get(self, update: WeightUpdate) -> tuple[Any, str]:
        import ray

        with self._lock:
            key = (update.version, id(update.state))
            if key != self._key:
                state = {n: t.detach().to("cpu") for n, t in (update.state or {}).items()}
                self._ref, self._checksum = ray.put(state), state_checksum(state)
                self._key = key
            return self._ref, self._checksum


class ObjectStoreWeights:
    """WeightSync for one Ray engine actor: the state through the object store (pools.weights.WeightSync)."""

    def __init__(self, engine: Any, cache: _StoreCache, version: int = 0, timeout_s: float = 600.0) -> None:
        self.engine = engine
        """ray_backend.RayEngine: `.actor` (the live actor handle) and `.call(method, *args)`."""
        self.cache = cache
        self._version = version
        self.timeout_s = timeout_s

    @property
    def version(self) -> int:
        return self._version

    def reset(self) -> None:
        """The actor was replaced: it holds its initial weights, so the newest update is applied again."""
        self._version = -1

    def apply(self, update: WeightUpdate) -> None:
        if update.version <= self._version:
            return
        if update.state is None:
            raise ValueError(f"weight update {update.version} carries no tensors for a Ray engine")
        ref, checksum = self.cache.get(update)
        got_version, got = self.engine.call("load_state", update.version, ref, update.kind, timeout_s=self.timeout_s)
        check_delivery(update.version, checksum, got_version, got)
        self._version = update.version


def check_delivery(version: int, sent: str, got_version: int, got: str) -> None:
    if got != sent:
        raise RuntimeError(f"weight update {version}: the engine received checksum {got[:12]}, the learner sent "
                           f"{sent[:12]}")
    if got_version != version:
        raise RuntimeError(f"weight update {version}: the engine reports version {got_version} after loading it")


# --------------------------------------------------------------------------------------------- NCCL


def nccl_group(host: str, port: int, rank: int, world: int, timeout_s: float = 300.0, backend: str = "nccl") -> Any:
    """A torch ProcessGroupNCCL of `world` ranks on a TCPStore at host:port (rank 0 hosts the store),
    independent of the default process group. `backend="gloo"`: the same group over Gloo (CPU tensors: the
    tests run the whole broadcast path with it)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("thinkcraft-weights", dist.TCPStore(host, port, world, is_master=rank == 0,
                                                                 timeout=timeout))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def broadcast(group: Any, tensor: Any) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def nccl_send(group: Any, state: dict[str, Any], bucket_bytes: int, device: Any) -> str:
    """Rank 0: the state as bf16 buckets; returns the digest of what was sent (bucket fingerprints)."""
    import torch

    metas = tensor_metas(state)
    prints = []
    for idx in plan_buckets(metas, 2, bucket_bytes):
        flat = pack_bucket([state[metas[i].name] for i in idx], torch.bfloat16, device)
        broadcast(group, flat)
        prints.append(bucket_fingerprint(flat))
    return buckets_digest(prints)


def nccl_receive(group: Any, metas: Sequence[TensorMeta], bucket_bytes: int,
                 device: Any) -> tuple[dict[str, Any], str]:
    """Ranks 1..K: the buckets `nccl_send` broadcasts, as name -> bf16 tensor on `device`, and their digest."""
    import torch

    out: dict[str, Any] = {}
    prints = []
    for idx in plan_buckets(metas, 2, bucket_bytes):
        ms = [metas[i] for i in idx]
        flat = torch.empty(sum(m.numel for m in ms), dtype=torch.bfloat16, device=device)
        broadcast(group, flat)
        prints.append(bucket_fingerprint(flat))
        out.update({m.name: t for m, t in zip(ms, unpack_bucket(flat, ms))})
    return out, buckets_digest(prints)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class NcclBroadcast:
    """Rank 0 of the weight group (the learner's process): one broadcast per version to every engine actor.

    `engines()` gives the live RayEngine of each rank 1..K; after an actor was replaced (`invalidate`) the
    next send rebuilds the group with the current actors on a fresh port."""

    def __init__(self, engines: Callable[[], list[Any]], device: Any, bucket_mb: float = 256.0,
                 timeout_s: float = 600.0, backend: str = "nccl") -> None:
        self.engines = engines
        self.backend = backend
        self.device = device
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self.timeout_s = timeout_s
        self._lock = threading.RLock()  # a replacement during send resets (invalidate) from the same thread
        self._group: Any = None
        self.sent: dict[int, str] = {}
        """version -> digest sent (bucket fingerprints), for the version last broadcast to the current group."""
        self.results: dict[int, list[tuple[int, str]]] = {}

    def invalidate(self) -> None:
        with self._lock:
            self._group = None
            self.sent.clear()
            self.results.clear()

    def _build(self) -> None:
        import ray

        engines = self.engines()
        host, port = ray.util.get_node_ip_address(), _free_port()
        world = len(engines) + 1
        joins = [e.actor.nccl_join.remote(host, port, k + 1, world, self.backend) for k, e in enumerate(engines)]
        self._group = nccl_group(host, port, 0, world, self.timeout_s, self.backend)
        ray.get(joins, timeout=self.timeout_s)

    def send(self, update: WeightUpdate) -> tuple[str, list[tuple[int, str]]]:
        """Broadcast `update` once (later calls for the same version return the first result):
        (the digest sent, per engine (version, digest received))."""
        import ray

        with self._lock:
            if update.version in self.sent:
                return self.sent[update.version], self.results[update.version]
            if self._group is None:
                self._build()
            state = update.state or {}
            metas = tensor_metas(state)
            recv = [e.actor.nccl_load.remote(update.version, metas, self.bucket_bytes, update.kind)
                    for e in self.engines()]
            try:
                sent = nccl_send(self._group, state, self.bucket_bytes, self.device)
                results = ray.get(recv, timeout=self.timeout_s)
            except Exception:
                self._group = None  # a half-done broadcast leaves the group unusable: rebuilt next time
                for e in self.engines():  # a dead engine is replaced now (else its slot would wait on it)
                    try:
                        e.call("ready", timeout_s=60.0)
                    except Exception:  # noqa: BLE001 - replaced (ActorLost), or to be found by its slot
                        pass
                raise
            self.sent = {update.version: sent}
            self.results = {update.version: results}
            return sent, results


def nccl_syncs(engines: list[Any], device: Any, bucket_mb: float, timeout_s: float, groups: str = "per-engine",
               version: int = 0, backend: str = "nccl") -> list["NcclWeights"]:
    """The NCCL WeightSync of each engine (`engines`: the live RayEngine list, replaced actors included).

    groups="per-engine" (the default): a group of the learner and one engine each; an engine's slot sends it
    a version when that slot applies it, between the engine's own batches. "shared": one group of every
    engine, one broadcast per version - but the first slot to apply a version waits for every other engine
    to finish the batch it is running (an engine loads weights between batches): on 4 x H200 (2026-11-28,
    Craftax-free arith, 16 prompts x 4 per engine) a weight update took 0.10 s with one engine, 1.44 s with
    two and 2.21 s with three (`weights/update_s`; one broadcast alone: 0.038 s, BENCHMARKS §8). Per-engine
    groups send the learner's state once per engine (NVLink: ~0.04 s each for 0.5B bf16), no engine waits
    for another."""
    if groups == "shared":
        bcast = NcclBroadcast(lambda: engines, device, bucket_mb, timeout_s, backend)
        return [NcclWeights(k, bcast, version) for k in range(len(engines))]
    if groups != "per-engine":
        raise ValueError(f"groups must be 'per-engine' or 'shared', got {groups!r}")
    return [NcclWeights(0, NcclBroadcast(lambda k=k: [engines[k]], device, bucket_mb, timeout_s, backend), version)
            for k in range(len(engines))]


class NcclWeights:
    """WeightSync for the k-th Ray engine actor on the NCCL path (`nccl_syncs`: a group per engine, rank 0 of
    its own broadcast, or one broadcast shared by all slots).

    With a shared group, the first slot to apply version v broadcasts it to every engine, so an engine may
    hold v while its own slot still reports v-1 (until that slot's apply confirms it): its tokens are then
    labelled one version older than the weights that made them. Staleness is over-, never under-estimated;
    behaviour log-probs are always the actual weights'."""

    device_tensors = True
    """The learner publishes its state on its own device (async_build.weight_update): the buckets are packed
    there, with no round trip through the CPU."""

    def __init__(self, rank: int, bcast: NcclBroadcast, version: int = 0) -> None:
        self.rank = rank
        self.bcast = bcast
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def reset(self) -> None:
        self._version = -1
        self.bcast.invalidate()

    def apply(self, update: WeightUpdate) -> None:
        if update.version <= self._version:
            return
        sent, results = self.bcast.send(update)
        got_version, got = results[self.rank]
        check_delivery(update.version, sent, got_version, got)
        self._version = update.version
