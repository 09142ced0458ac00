"""Batched semantic extraction: env states (device) -> a few small integer arrays per env.

One jitted function turns a batch of Craftax or Craftax-Classic states (bare or inside wrappers) into
a `Semantic`: the view of blocks / items / mobs / light around the player, inventory, vitals,
direction and flags. It runs where the states live (GPU in training), and the result is ~0.6 KB per
env, so `jax.device_get` is cheap; the host renderers (`render.py`) turn it into text.

The mob layer replicates `craftax.craftax.renderer.render_craftax_text` exactly, quirks included:
each mob slot writes `on_screen` (0 or 1) into a (rows, cols, 40) map with `.at[].set`, in the
renderer's class order, so a dead or off-screen slot can clear an earlier write at its (wrapped)
position, and the tile shows the lowest identifier still set.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from craftax.craftax import constants as C
from craftax.craftax.craftax_state import EnvState as CraftaxState
from craftax.craftax_classic import constants as CC
from craftax.craftax_classic.envs.craftax_state import EnvState as ClassicState

from thinkcraft.envs.craftax import unwrap_env_state
from thinkcraft.envs.text.names import MOB_TYPES_PER_CLASS
from thinkcraft.utils.errors import UserError

NO_MOB = -1


class Semantic(NamedTuple):
    """What the renderers need, per env. Leading axis N (envs) when batched; absent for one state.

    View arrays are (N, rows, cols) with the player at the centre: Craftax 9 x 11, Classic 7 x 9.
    Unused parts for Classic are zeros of the same rank (items, enchantments, floor).
    """

    block: jax.Array  # (N, R, C) uint8: BlockType value (OUT_OF_BOUNDS past the map edge)
    item: jax.Array  # (N, R, C) uint8: ItemType value (Craftax; Classic: 0)
    mob: jax.Array  # (N, R, C) int8: mob identifier as render_craftax_text sees it, -1 for none
    light: jax.Array  # (N, R, C) bool: lit (light_map > 0.05; Classic: always True)
    inventory: jax.Array  # (N, K) int16: names.INVENTORY_FIELDS[kind]
    stats: jax.Array  # (N, S) int16: names.STAT_FIELDS[kind]
    health: jax.Array  # (N,) float32: player_health (a float in Craftax)
    light_level: jax.Array  # (N,) float32: daylight, 1 = noon
    direction: jax.Array  # (N,) int8: 1 left/west, 2 right/east, 3 up/north, 4 down/south
    floor: jax.Array  # (N,) int8: player_level (Classic: 0)
    flags: jax.Array  # (N, F) bool: names.FLAG_FIELDS[kind]
    enchant: jax.Array  # (N, 6) int8: names.ENCHANT_FIELDS (0 none, 1 fire, 2 ice)


def env_kind_of(state: Any) -> str:
    """'craftax' or 'craftax-classic' for a (possibly wrapped, possibly batched) env state."""
    core = unwrap_env_state(state)
    if isinstance(core, CraftaxState):
        return "craftax"
    if isinstance(core, ClassicState):
        return "craftax-classic"
    raise UserError(
        f"expected a Craftax or Craftax-Classic EnvState (or a wrapper state with .env_state), "
        f"got {type(core).__module__}.{type(core).__qualname__}"
    )


def _window(grid: jax.Array, pos: jax.Array, shape: tuple[int, int], fill) -> jax.Array:
    """`grid` around `pos` (shape rows x cols), `fill` outside: the padded dynamic_slice of craftax."""
    rows = pos[0] - shape[0] // 2 + jnp.arange(shape[0])
    cols = pos[1] - shape[1] // 2 + jnp.arange(shape[1])
    inside = ((rows >= 0) & (rows < grid.shape[0]))[:, None] & ((cols >= 0) & (cols < grid.shape[1]))[None, :]
    vals = grid[jnp.clip(rows, 0, grid.shape[0] - 1)[:, None], jnp.clip(cols, 0, grid.shape[1] - 1)[None, :]]
    return jnp.where(inside, vals, jnp.asarray(fill, grid.dtype))


def _mob_layer(groups, player_pos: jax.Array, shape: tuple[int, int], num_ids: int) -> jax.Array:
    """Per view tile the lowest mob identifier set, -1 for none (render_craftax_text's semantics).

    `groups` is a list of (positions (M, 2), mask (M,), identifiers (M,)) in the renderer's order.
    """
    mob_map = jnp.zeros((*shape, num_ids), dtype=jnp.bool_)
    centre = jnp.array(shape, dtype=jnp.int32) // 2
    for positions, mask, ids in groups:
        for m in range(mask.shape[0]):
            local = positions[m] - player_pos + centre
            on_screen = jnp.logical_and(local >= 0, local < jnp.array(shape)).all() & mask[m]
            # same .at[].set as craftax: negative indices wrap, too-large ones are dropped
            mob_map = mob_map.at[local[0], local[1], ids[m]].set(on_screen)
    return jnp.where(mob_map.any(-1), jnp.argmax(mob_map, -1), NO_MOB).astype(jnp.int8)


def _extract_craftax(s: CraftaxState) -> Semantic:
    shape = tuple(C.OBS_DIM)
    lvl = s.player_level
    pos = s.player_position
    block = _window(s.map[lvl], pos, shape, C.BlockType.OUT_OF_BOUNDS.value)
    item = _window(s.item_map[lvl], pos, shape, C.ItemType.NONE.value)
    light = _window(s.light_map[lvl], pos, shape, 0.0) > 0.05
    groups = []
    for cls, mobs in enumerate(
        (s.melee_mobs, s.passive_mobs, s.ranged_mobs, s.mob_projectiles, s.player_projectiles)
    ):
        groups.append((mobs.position[lvl], mobs.mask[lvl], cls * MOB_TYPES_PER_CLASS + mobs.type_id[lvl]))
    mob = _mob_layer(groups, pos, shape, 5 * MOB_TYPES_PER_CLASS)
    inv = s.inventory
    inventory = jnp.concatenate(
        [
            jnp.stack(
                [inv.wood, inv.stone, inv.coal, inv.iron, inv.diamond, inv.sapphire, inv.ruby, inv.sapling,
                 inv.torches, inv.arrows, inv.books, inv.pickaxe, inv.sword, inv.bow]
            ),
            inv.potions,
            inv.armour,
        ]
    ).astype(jnp.int16)  # fmt: skip
    stats = jnp.stack(
        [s.player_food, s.player_drink, s.player_energy, s.player_mana, s.player_xp, s.player_dexterity,
         s.player_strength, s.player_intelligence]
    ).astype(jnp.int16)  # fmt: skip
    boss_vulnerable = (
        (s.melee_mobs.mask[lvl].sum() == 0)
        & (s.ranged_mobs.mask[lvl].sum() == 0)
        & (s.boss_timesteps_to_spawn_this_round <= 0)
    )
    flags = jnp.stack(
        [s.is_sleeping, s.is_resting, s.learned_spells[0], s.learned_spells[1],
         s.monsters_killed[lvl] >= C.MONSTERS_KILLED_TO_CLEAR_LEVEL, boss_vulnerable]
    ).astype(jnp.bool_)  # fmt: skip
    enchant = jnp.concatenate(
        [jnp.stack([s.sword_enchantment, s.bow_enchantment]), s.armour_enchantments]
    ).astype(jnp.int8)
    return Semantic(
        block=block.astype(jnp.uint8),
        item=item.astype(jnp.uint8),
        mob=mob,
        light=light,
        inventory=inventory,
        stats=stats,
        health=jnp.asarray(s.player_health, jnp.float32),
        light_level=jnp.asarray(s.light_level, jnp.float32),
        direction=jnp.asarray(s.player_direction, jnp.int8),
        floor=jnp.asarray(lvl, jnp.int8),
        flags=flags,
        enchant=enchant,
    )


def _extract_classic(s: ClassicState) -> Semantic:
    shape = tuple(CC.OBS_DIM)
    pos = s.player_position
    block = _window(s.map, pos, shape, CC.BlockType.OUT_OF_BOUNDS.value)
    groups = []
    for cls, mobs in enumerate((s.zombies, s.cows, s.skeletons, s.arrows)):
        groups.append((mobs.position, mobs.mask, jnp.full(mobs.mask.shape, cls, jnp.int32)))
    mob = _mob_layer(groups, pos, shape, 4)
    inv = s.inventory
    inventory = jnp.stack(
        [inv.wood, inv.stone, inv.coal, inv.iron, inv.diamond, inv.sapling, inv.wood_pickaxe,
         inv.stone_pickaxe, inv.iron_pickaxe, inv.wood_sword, inv.stone_sword, inv.iron_sword]
    ).astype(jnp.int16)  # fmt: skip
    return Semantic(
        block=block.astype(jnp.uint8),
        item=jnp.zeros(shape, jnp.uint8),
        mob=mob,
        light=jnp.ones(shape, jnp.bool_),
        inventory=inventory,
        stats=jnp.stack([s.player_food, s.player_drink, s.player_energy]).astype(jnp.int16),
        health=jnp.asarray(s.player_health, jnp.float32),
        light_level=jnp.asarray(s.light_level, jnp.float32),
        direction=jnp.asarray(s.player_direction, jnp.int8),
        floor=jnp.zeros((), jnp.int8),
        flags=jnp.stack([s.is_sleeping]).astype(jnp.bool_),
        enchant=jnp.zeros((6,), jnp.int8),
    )


@functools.partial(jax.jit, static_argnames=("batched",))
def extract(states: Any, batched: bool = True) -> Semantic:
    """Semantic arrays for a batch of env states (or one state with `batched=False`).

    Accepts bare craftax EnvStates and wrapper states that hold one in `.env_state` (nested).
    Jitted: one compile per env kind, batch size and `batched`.
    """
    core = unwrap_env_state(states)
    kind = env_kind_of(core)
    want = 2 if batched else 1
    if core.player_position.ndim != want:
        raise UserError(
            f"extract(batched={batched}) expects player_position of rank {want}, got shape "
            f"{tuple(core.player_position.shape)}; pass batched={core.player_position.ndim == 2}"
        )
    fn = _extract_craftax if kind == "craftax" else _extract_classic
    return jax.vmap(fn)(core) if batched else fn(core)
