"""`--devices D`: one training program's envs split over D devices (data-parallel PPO, JAX-native).

    shards = make_shards(cfg.devices)                          # D devices of a Mesh (or all: --devices all)
    env = make_env(name, num_envs // D, ...)                   # each shard steps its own n = N / D envs
    runner = shards.place(init(...), RUNNER_AXES)              # shard axis leading on the per-env state
    chunk = jax.jit(over_shards(make_train_chunk(env, ..., axis_name=shards.axis_name), shards,
                                (RUNNER_AXES,), (RUNNER_AXES, None)))

Layout: every per-env leaf (env states, observations, a recurrent memory, the rollout's PRNG key) gets a
leading shard axis of size D, split over the mesh's one axis (`NamedSharding(mesh, P(AXIS))`); the
parameters, the optimizer state and the update counter are replicated. `over_shards` runs a function
written for one shard (its cross-shard reductions named by `AXIS`) as a `jax.shard_map` over the mesh: each
device runs its shard's rollout with no communication, and the PPO update averages each minibatch's
gradients across devices (`lax.pmean`, one all-reduce per Adam step; rl/ppo.py). Advantages are normalised
with the whole minibatch's mean and std, and the loss metrics and episode sums are reduced over the shards,
so a step's update is that of one device on the same global minibatch.

What differs from one device with N envs (by design; the same holds for any data-parallel PPO):
* each shard's envs have their own PRNG streams and their own optimistic resets (N / (D · ratio) fresh
  worlds per shard per step: the same number in all);
* a minibatch is stratified: each shard shuffles its own (step, env) pairs (whole env sequences for
  --policy rnn) and contributes batch / (D · minibatches) of them, so no sample crosses devices.

`EnvShards(D, mesh=None)` runs the very same per-shard function as `jax.vmap(..., axis_name=AXIS)` on one
device: the one-device program for the same global batch, which the tests compare the sharded one
against (tests/test_sharding.py; equal up to float summation order). D = 1 is no shard axis at all: the
program, the checkpoint layout and the metrics are exactly the single-device ones.

Multi-host (`jax.distributed`, README "Scale-out"): after `initialize_distributed` every process sees the
global device list; `--devices all` then spans every host, each process feeding its local devices' shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from thinkcraft.utils.errors import UserError

AXIS = "envs"
"""The mesh axis (and the collectives' axis name) the envs are split over."""


def _is_axis_leaf(x: Any) -> bool:
    return x is None or isinstance(x, int)


@dataclass(frozen=True)
class EnvShards:
    """`count` env shards: on `mesh` (one device each), or emulated on one device by vmap (mesh None)."""

    count: int
    mesh: Any = None  # jax.sharding.Mesh with the one axis AXIS, or None

    @property
    def axis_name(self) -> str | None:
        """The collectives' axis name inside the per-shard functions; None for one shard (no collectives)."""
        return AXIS if self.count > 1 else None

    def local(self, num: int) -> int:
        """Per-shard size of a global count of envs (or reset-pool worlds)."""
        return num // self.count

    def shardings(self, axes: Any, num_seeds: int = 1) -> Any:
        """NamedShardings of a state whose leaves carry the shard axis where `axes` says 0 (after a
        leading seed axis when num_seeds > 1); None without a mesh."""
        if self.mesh is None:
            return None
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        lead = (None,) if num_seeds > 1 else ()
        return jax.tree.map(lambda a: NamedSharding(self.mesh, P(*lead, AXIS) if a == 0 else P()), axes,
                            is_leaf=_is_axis_leaf)

    def place(self, state: Any, axes: Any, num_seeds: int = 1) -> Any:
        """`state` laid out over the mesh (per-env leaves split, the rest replicated); unchanged without one."""
        if self.mesh is None or self.count == 1:
            return state
        if jax.process_count() > 1:  # the same host value on every process: each keeps its devices' part
            state = jax.device_get(state)
        shardings = self.shardings(axes, num_seeds)
        return jax.tree.map(lambda s, sub: jax.device_put(sub, s), shardings, state,
                            is_leaf=lambda x: hasattr(x, "spec"))

    def replicate(self, x: Any) -> Any:
        """`x` on every device of the mesh (a refresh's hidden states, which every shard reads)."""
        if self.mesh is None or self.count == 1:
            return x
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return jax.device_put(x, NamedSharding(self.mesh, P()))


def make_shards(devices: int | str) -> EnvShards:
    """`--devices N|all` -> EnvShards over the first N of `jax.devices()` (every process's, after
    initialize_distributed). One device: EnvShards(1), the unsharded program."""
    from jax.sharding import Mesh

    available = jax.devices()
    count = len(available) if devices == "all" else int(devices)
    if count < 1:
        raise UserError(f"--devices must be >= 1 or 'all', got {devices}")
    if count > len(available):
        raise UserError(f"--devices {count}: JAX sees only {len(available)} device(s) "
                        f"({available[0].platform}); use --devices {len(available)} or all")
    if count == 1:
        return EnvShards(1)
    return EnvShards(count, Mesh(np.array(available[:count]), (AXIS,)))


def over_shards(fn: Callable, shards: EnvShards, in_axes: Any, out_axes: Any) -> Callable:
    """A function written for one shard -> the same over all shards. `in_axes` / `out_axes`: pytree
    prefixes of the arguments (a tuple, one entry per argument) / of the result, 0 where a leaf carries the
    leading shard axis, None where it is replicated (same value on every shard). One shard: `fn` itself.

    With a mesh: `jax.shard_map`, each device one shard (its block's shard axis of size 1 is dropped for
    `fn` and restored after). Without: `jax.vmap(fn, in_axes, out_axes, axis_name=AXIS)` on one device.

    `check_vma=False`: with it on, shard_map types a replicated input as invariant and its gradient inside
    `fn` comes back already summed over the shards (the transpose of the implicit broadcast is a psum);
    off, a gradient inside `fn` is the shard's own, as under vmap, so the same per-shard code (rl/ppo.py's
    explicit `pmean` of the gradients) is right in both. The replicated outputs are replicated because
    `fn` reduces them (tests/test_sharding.py checks the shards agree)."""
    if shards.count == 1:
        return fn
    if shards.mesh is None:
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=AXIS)
    from jax.sharding import PartitionSpec as P

    def spec(a: Any) -> Any:
        return P(AXIS) if a == 0 else P()

    def squeeze(axes: Any, tree: Any, expand: bool) -> Any:
        def one(a: Any, sub: Any) -> Any:
            if a != 0:
                return sub
            return jax.tree.map(lambda x: x[None] if expand else x[0], sub)

        return jax.tree.map(one, axes, tree, is_leaf=_is_axis_leaf)

    def body(*args: Any) -> Any:
        return squeeze(out_axes, fn(*squeeze(tuple(in_axes), args, False)), True)

    return jax.shard_map(body, mesh=shards.mesh, check_vma=False,
                         in_specs=jax.tree.map(spec, tuple(in_axes), is_leaf=_is_axis_leaf),
                         out_specs=jax.tree.map(spec, out_axes, is_leaf=_is_axis_leaf))


def stack_shards(x: Any, count: int) -> Any:
    """Every leaf of `x` repeated along a new leading shard axis (a per-env initial value each shard starts
    from, e.g. a zero memory)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (count,) + jnp.shape(a)), x)


def shard_rows(x: jax.Array, rows: int, axis_name: str) -> jax.Array:
    """This shard's `rows` rows of an array replicated on every shard whose axis -2 holds all shards' rows
    in shard order (shard d: rows d·rows .. (d+1)·rows - 1): a refresh's hidden states (N, H)."""
    start = jax.lax.axis_index(axis_name) * rows
    return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=x.ndim - 2)


def gather_to_host(state: Any) -> Any:
    """`state` whole on this host (a checkpoint's view): itself on one host, where every array is
    addressable; across hosts every process gathers the global arrays (process_allgather)."""
    if jax.process_count() == 1:
        return state
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(state, tiled=True)


def agree(flag: bool) -> bool:
    """Process 0's `flag` on every process (one host: `flag`). A decision that leads to a collective (a
    checkpoint's gather) must be the same everywhere: a time-based one differs between hosts' clocks."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> None:
    """`jax.distributed.initialize` for a multi-host run (before anything touches a device); 'auto' (or
    None fields) lets JAX detect them from SLURM / Open MPI / Kubernetes. A no-op after the first call."""
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return
    jax.distributed.initialize(None if coordinator_address == "auto" else coordinator_address,
                               num_processes, process_id)
