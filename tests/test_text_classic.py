"""thinkcraft.envs.text on Craftax-Classic: hand-checked states in both formats.

Classic has no text renderer of its own; its `craftax` format follows craftax's layout. The test
checks it against a plain per-tile reference written here from that layout, plus literal goldens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from craftax.craftax_classic.constants import BlockType

from thinkcraft.envs.text import env_kind_of, extract, render, render_states
from thinkcraft.envs.text.rollout import random_rollout
from thinkcraft.utils.errors import UserError

R, C = 30, 30  # player position in the hand-made world


@pytest.fixture(scope="module")
def classic_state():
    """A Classic state from reset, edited: grass world, known blocks, mobs, inventory, vitals."""
    _, states = next(iter(random_rollout("craftax-classic", 8, 0, seed=0)))
    s = jax.tree_util.tree_map(lambda x: x[0], states)
    world = np.full(np.shape(s.map), BlockType.GRASS.value, np.int32)
    for dr, dc, b in [
        (0, 1, BlockType.TREE), (-1, 1, BlockType.TREE), (1, 3, BlockType.STONE), (1, 4, BlockType.STONE),
        (2, 4, BlockType.COAL), (-3, -4, BlockType.WATER), (3, 0, BlockType.SAND), (0, -1, BlockType.PATH),
        (-2, -2, BlockType.CRAFTING_TABLE),
    ]:  # fmt: skip
        world[R + dr, C + dc] = b.value

    def mobs(m, positions):
        mask = np.zeros(np.shape(m.mask), bool)
        pos = np.array(m.position)
        for k, p in enumerate(positions):
            mask[k], pos[k] = True, p
        return m.replace(mask=jnp.asarray(mask), position=jnp.asarray(pos))

    inv = s.inventory.replace(
        wood=jnp.int32(5), stone=jnp.int32(0), coal=jnp.int32(1), iron=jnp.int32(0), diamond=jnp.int32(0),
        sapling=jnp.int32(0), wood_pickaxe=jnp.int32(1), stone_pickaxe=jnp.int32(0), iron_pickaxe=jnp.int32(0),
        wood_sword=jnp.int32(1), stone_sword=jnp.int32(0), iron_sword=jnp.int32(0),
    )  # fmt: skip
    return s.replace(
        map=jnp.asarray(world), player_position=jnp.array([R, C], jnp.int32), player_direction=jnp.int32(2),
        zombies=mobs(s.zombies, [(R - 2, C + 3)]),
        cows=mobs(s.cows, [(R + 1, C - 2), (R + 10, C)]),  # the second is out of view
        skeletons=mobs(s.skeletons, []), arrows=mobs(s.arrows, [(R, C - 3)]),
        inventory=inv, player_health=jnp.int32(9), player_food=jnp.int32(7), player_drink=jnp.int32(8),
        player_energy=jnp.int32(6), is_sleeping=jnp.bool_(False), light_level=jnp.float32(0.25),
    )  # fmt: skip


def _reference_craftax_format(s) -> str:
    """Per-tile reference of Classic in craftax's layout (rows x, columns y; 'col, row: ...')."""
    rows, cols = 7, 9
    mob_names = ("Zombie", "Cow", "Skeleton", "Arrow")
    pos = np.array(s.player_position)
    world = np.array(s.map)
    lines = ["Map:\n"]
    for x in range(rows):
        for y in range(cols):
            mr, mc = pos[0] - rows // 2 + x, pos[1] - cols // 2 + y
            inside = 0 <= mr < world.shape[0] and 0 <= mc < world.shape[1]
            block = BlockType(world[mr, mc]).name.lower() if inside else "out_of_bounds"
            mob = None
            for k, group in enumerate((s.zombies, s.cows, s.skeletons, s.arrows)):
                for p, alive in zip(np.array(group.position), np.array(group.mask)):
                    if alive and tuple(p) == (mr, mc) and mob is None:
                        mob = mob_names[k]
            lines.append(f"{y - cols // 2}, {x - rows // 2}: " + (f"{mob} on " if mob else "") + block + "\n")
    inv = s.inventory
    labels = ["Wood", "Stone", "Coal", "Iron", "Diamond", "Sapling", "Wood Pickaxe", "Stone Pickaxe",
              "Iron Pickaxe", "Wood Sword", "Stone Sword", "Iron Sword"]  # fmt: skip
    values = [inv.wood, inv.stone, inv.coal, inv.iron, inv.diamond, inv.sapling, inv.wood_pickaxe,
              inv.stone_pickaxe, inv.iron_pickaxe, inv.wood_sword, inv.stone_sword, inv.iron_sword]  # fmt: skip
    lines.append("\nInventory:\n")
    lines += [f"{label}: {int(v)}\n" for label, v in zip(labels, values)]
    direction = ("noop", "left", "right", "up", "down")[int(s.player_direction)]
    lines.append(
        f"Health: {int(s.player_health)}\nFood: {int(s.player_food)}\nDrink: {int(s.player_drink)}\n"
        f"Energy: {int(s.player_energy)}\nDirection: {direction}\nLight: {float(s.light_level)}\n"
        f"Is Sleeping: {bool(s.is_sleeping)}\n"
    )
    return "".join(lines)


GOLDEN_COMPACT = """\
night, facing east: tree
zombie (-2,+3)
cow (+1,-2)
arrow (0,-3)
water (-3,-4)
stone (+1,+3) (+1,+4)
tree (0,+1) (-1,+1)
coal (+2,+4)
crafting table (-2,-2)
inventory: wood 5, coal 1, wood pickaxe, wood sword
health 9, food 7, drink 8, energy 6"""


@pytest.mark.slow
def test_classic_hand_checked(classic_state):
    s = classic_state
    assert env_kind_of(s) == "craftax-classic"
    sem = jax.device_get(extract(s, batched=False))
    text = render(sem, "craftax", env_kind="Craftax-Classic-Symbolic-v1")[0]
    assert text == _reference_craftax_format(s)
    # hand-checked lines: east of the player a tree, a zombie 2 up 3 right, the arrow 3 left
    for line in ("1, 0: tree\n", "3, -2: Zombie on grass\n", "-3, 0: Arrow on grass\n", "-2, 1: Cow on grass\n",
                 "0, 0: grass\n", "Wood Pickaxe: 1\n", "Direction: right\n", "Light: 0.25\n"):  # fmt: skip
        assert line in text, line
    assert text.count("\n") == 1 + 63 + 2 + 12 + 7
    assert render(sem, "compact") == [GOLDEN_COMPACT]
    # a tile with more than COMPACT_MAX_TILES of its kind: counted, the nearest three listed (Manhattan distance)
    world = np.array(s.map)
    world[R + 3, C + 1 : C + 4] = BlockType.STONE.value  # 2 + 3 stones
    many = jax.device_get(extract(s.replace(map=jnp.asarray(world)), batched=False))
    assert "\nstone x5 (+1,+3) (+3,+1) (+1,+4)\n" in render(many, "compact")[0]


@pytest.mark.slow
def test_classic_edge_of_map_and_batch(classic_state):
    # at the map corner the view runs out of bounds; batch of 8 envs renders like each alone
    corner = classic_state.replace(player_position=jnp.array([0, 1], jnp.int32))
    sem = jax.device_get(extract(corner, batched=False))
    text = render(sem, "craftax")[0]
    assert text == _reference_craftax_format(corner)
    assert "-4, -3: out_of_bounds\n" in text
    batch = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *([classic_state] * 7 + [corner]))
    texts = render_states(batch, "craftax")
    assert texts[0] == _reference_craftax_format(classic_state) and texts[7] == text
    with pytest.raises(UserError, match="craftax-classic"):
        render(sem, "compact", env_kind="craftax")
