"""K independent seeds in one compiled program (Craftax_Baselines' NUM_REPEATS): a leading seed axis on
the whole training state, the jitted kernels vmapped over it.

    states = init_seeds(jax.jit(init), seed, K)       # seed i starts as a run with `seed + i` would
    chunk = over_seeds(make_train_chunk(...), K)      # jax.vmap when K > 1; the function itself when K = 1
    for i, m in enumerate(split_seeds(metrics, K)):   # one record per seed
        ...

Seed i of a K-seed run is the run `--seed seed+i`: each seed's state is initialised by the same jitted
`init` on `PRNGKey(seed + i)` (bit-identical to a single run's, and no vmapped orthogonal init: on a CPU a
batched QR can deadlock jaxlib's thread pool), then stacked. After that every op is per seed (threefry
keys are data, so random draws under vmap are the unbatched ones); only the arithmetic of batched
matmuls and reductions may differ in its last bits (tests/test_seeds.py states the tolerance).

K = 1 keeps no seed axis at all: the program, the checkpoint layout and the metrics are a single run's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def seed_keys(seed: int, num_seeds: int) -> list[jax.Array]:
    """The PRNG key of each seed: seed i is `PRNGKey(seed + i)`, a single run's key for `--seed seed+i`."""
    return [jax.random.PRNGKey(seed + i) for i in range(num_seeds)]


def stack_seeds(states: list[Any]) -> Any:
    """Pytrees of equal structure -> one with a leading seed axis (static fields, e.g. a TrainState's
    apply_fn and tx, are shared)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def init_seeds(init: Callable[[jax.Array], Any], seed: int, num_seeds: int) -> Any:
    """`init(key)` for each seed's key: a single state when num_seeds = 1, else the states stacked."""
    keys = seed_keys(seed, num_seeds)
    if num_seeds == 1:
        return init(keys[0])
    return stack_seeds([init(k) for k in keys])


def seeds_template(init: Callable[[jax.Array], Any], seed: int, num_seeds: int) -> Any:
    """Shapes and dtypes of `init_seeds(init, seed, num_seeds)` without running it (a checkpoint template)."""
    keys = seed_keys(seed, num_seeds)
    if num_seeds == 1:
        return jax.eval_shape(init, keys[0])
    return jax.eval_shape(jax.vmap(init), jnp.stack(keys))


def over_seeds(fn: Callable, num_seeds: int, in_axes: Any = 0) -> Callable:
    """`fn` over a leading seed axis of its arguments and results (`jax.vmap`); `fn` itself when num_seeds
    = 1, so a single seed's program is exactly the unvmapped one."""
    return fn if num_seeds == 1 else jax.vmap(fn, in_axes=in_axes)


def seed_slice(tree: Any, index: int, num_seeds: int) -> Any:
    """Seed `index`'s part of a (possibly) seed-stacked pytree (the tree itself when num_seeds = 1)."""
    return tree if num_seeds == 1 else jax.tree.map(lambda x: x[index], tree)


def split_seeds(tree: Any, num_seeds: int) -> list[Any]:
    """[seed 0's tree, seed 1's, ...] of a host (numpy) pytree with a leading seed axis ([tree] for 1 seed)."""
    return [seed_slice(tree, i, num_seeds) for i in range(num_seeds)]
