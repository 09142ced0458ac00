"""Host renderers: `Semantic` (numpy) -> one string per env, vectorised.

No per-tile Python: each tile becomes one integer code, codes index precomputed string tables
(numpy object arrays), and every env's text is one `"".join` of its pieces. Per env, Python only
slices and joins; the craftax format also formats its ~40 inventory/vitals lines per env.

Formats
- `craftax`: byte-identical to `craftax.craftax.renderer.render_craftax_text` for Craftax states;
  for Craftax-Classic the same layout with Classic's blocks, mobs, inventory and vitals.
- `compact`: short text for LLMs, see COMPACT_FORMAT_DOC.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from thinkcraft.envs import craftax as craftax_envs
from thinkcraft.envs.text import names as N
from thinkcraft.envs.text.semantic import Semantic
from thinkcraft.utils.errors import UserError

FORMATS: tuple[str, ...] = ("compact", "craftax")

# compact: how many tiles of one kind are listed (nearest first); the rest only counted
COMPACT_MAX_TILES = 3

COMPACT_FORMAT_DOC = (
    "Observation format. Positions are (row, col) offsets from you; you are at (0,0). Row -1 is one "
    "tile north (up), row +1 south (down), col -1 west (left), col +1 east (right). Each map line "
    "`name (r,c) ...` lists the nearest tiles of that kind in view, nearest first (at most "
    f"{COMPACT_MAX_TILES}); `name x7 ...` means 7 of them are in view. Creatures come first, then "
    "items, then blocks. Walkable ground (grass, sand, path) is not listed; `dark tiles` cannot be "
    "seen. The first line gives the floor, the daylight (surface only) and the tile you face, which "
    "`do` acts on and placing puts things on. Inventory lists only what you have. Health, food, drink "
    "and energy go up to 9; at 0 food, drink or energy you lose health."
)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UserError(f"unknown text format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    return fmt


def _as_numpy(sem: Semantic) -> Semantic:
    """Host copy with a leading env axis (accepts device arrays and single-env semantics)."""
    arrs = [np.asarray(a) for a in sem]
    if arrs[0].ndim == 2:  # one env: block is (R, C)
        arrs = [a[None] for a in arrs]
    return Semantic(*arrs)


def kind_of_semantic(sem: Semantic) -> str:
    shape = tuple(np.shape(sem.block)[-2:])
    for kind, view in N.VIEW_SHAPE.items():
        if shape == view:
            return kind
    raise UserError(f"not a Semantic of a known env: view shape {shape}")


def render(sem: Semantic, fmt: str = "compact", env_kind: str | None = None) -> list[str]:
    """Text for every env in `sem` (output of `extract`, ideally already `jax.device_get`-ed)."""
    check_format(fmt)
    found = kind_of_semantic(sem)
    if env_kind is not None and craftax_envs.env_kind(env_kind) != found:
        raise UserError(
            f"render(env_kind={env_kind!r}) got the semantics of a {found!r} state "
            f"(view {tuple(np.shape(sem.block)[-2:])}); pass env_kind={found!r}"
        )
    sem = _as_numpy(sem)
    if fmt == "craftax":
        return _render_craftax_format(sem, found)
    return _render_compact(sem, found)


# ---------------------------------------------------------------------------------------------
# shared: one code per tile


def _tile_code(sem: Semantic, kind: str) -> np.ndarray:
    """(N, T) int32: 0 for a dark tile, else 1 + ((mob + 1) * n_items + item) * n_blocks + block."""
    n_blocks = len(N.BLOCK_NAMES[kind])
    n_items = len(N.ITEM_NAMES)
    n = sem.block.shape[0]
    block = sem.block.reshape(n, -1).astype(np.int32)
    item = sem.item.reshape(n, -1).astype(np.int32)
    mob = sem.mob.reshape(n, -1).astype(np.int32)
    code = 1 + ((mob + 1) * n_items + item) * n_blocks + block
    return np.where(sem.light.reshape(n, -1), code, 0)


@functools.lru_cache(maxsize=None)
def _craftax_tile_table(kind: str) -> np.ndarray:
    blocks, items, mobs = N.BLOCK_NAMES[kind], N.ITEM_NAMES, N.MOB_NAMES[kind]
    table = ["Darkness\n"]
    for m in range(-1, len(mobs)):
        for i in range(len(items)):
            for b in range(len(blocks)):
                text = (mobs[m] + " on " if m >= 0 else "") + (items[i] + " on " if i > 0 else "")
                table.append(text + blocks[b] + "\n")
    return np.array(table, dtype=object)


@functools.lru_cache(maxsize=None)
def _craftax_prefixes(kind: str) -> np.ndarray:
    rows, cols = N.VIEW_SHAPE[kind]
    # render_craftax_text prints "col_offset, row_offset: " (its x is the row, y the column)
    return np.array(
        [f"{y - cols // 2}, {x - rows // 2}: " for x in range(rows) for y in range(cols)], dtype=object
    )


# ---------------------------------------------------------------------------------------------
# craftax format

_MATERIAL = {1: "Wood", 2: "Stone", 3: "Iron", 4: "Diamond"}
_ENCHANT = {0: "No", 1: "Fire", 2: "Ice"}
_ARMOUR = {1: "Iron", 2: "Diamond"}
_ARMOUR_PARTS = ("Helmet", "Chestplate", "Leggings", "Boots")
_POTIONS = ("Red", "Green", "Blue", "Pink", "Cyan", "Yellow")


def _craftax_tail(inv: list, stats: list, health: float, light: float, direction: int, floor: int,
                  flags: list, ench: list) -> str:  # fmt: skip
    """Everything after the map, exactly as render_craftax_text prints it (one env)."""
    wood, stone, coal, iron, diamond, sapphire, ruby, sapling, torches, arrows, books = inv[:11]
    pickaxe, sword, bow = inv[11:14]
    potions, armour = inv[14:20], inv[20:24]
    parts = [
        f"\nInventory:\nWood: {wood}\nStone: {stone}\nCoal: {coal}\nIron: {iron}\nDiamond: {diamond}\n"
        f"Sapphire: {sapphire}\nRuby: {ruby}\nSapling: {sapling}\nTorch: {torches}\nArrow: {arrows}\n"
        f"Book: {books}\n"
    ]
    if pickaxe > 0:
        parts.append(f"{_MATERIAL.get(pickaxe)} Pickaxe\n")
    if sword > 0:
        parts.append(f"{_MATERIAL.get(sword)} Sword with {_ENCHANT.get(ench[0])} enchantment\n")
    if bow > 0:
        parts.append(f"Bow with {_ENCHANT.get(ench[1])} enchantment\n")
    for name, count in zip(_POTIONS, potions):
        parts.append(f"{name} potion: {count}\n")
    for part, level, e in zip(_ARMOUR_PARTS, armour, ench[2:]):
        if level > 0:
            parts.append(f"{_ARMOUR.get(level)} {part} with {_ENCHANT.get(e)} enchantment\n")
    food, drink, energy, mana, xp, dex, strength, intel = stats
    sleeping, resting, fireball, iceball, ladder_open, boss = flags
    parts.append(
        f"Health: {health}\nFood: {food}\nDrink: {drink}\nEnergy: {energy}\nMana: {mana}\nXP: {xp}\n"
        f"Dexterity: {dex}\nStrength: {strength}\nIntelligence: {intel}\n"
        f"Direction: {N.DIRECTION_NAMES[direction]}\nLight: {light}\nIs Sleeping: {sleeping}\n"
        f"Is Resting: {resting}\nLearned Fireball: {fireball}\nLearned Iceball: {iceball}\n"
        f"Floor: {floor}\nLadder Open: {ladder_open}\nIs Boss Vulnerable: {boss}\n"
    )
    return "".join(parts)


_CLASSIC_INV_LABELS = (
    "Wood", "Stone", "Coal", "Iron", "Diamond", "Sapling", "Wood Pickaxe", "Stone Pickaxe",
    "Iron Pickaxe", "Wood Sword", "Stone Sword", "Iron Sword",
)  # fmt: skip


def _classic_tail(inv: list, stats: list, health: float, light: float, direction: int, floor: int,
                  flags: list, ench: list) -> str:  # fmt: skip
    """Classic in the craftax layout: all inventory counts, vitals, direction, light, sleeping."""
    lines = ["\nInventory:\n"]
    lines += [f"{label}: {v}\n" for label, v in zip(_CLASSIC_INV_LABELS, inv)]
    food, drink, energy = stats
    # Classic keeps health as an int; print it as one
    lines.append(
        f"Health: {int(health)}\nFood: {food}\nDrink: {drink}\nEnergy: {energy}\n"
        f"Direction: {N.DIRECTION_NAMES[direction]}\nLight: {light}\nIs Sleeping: {flags[0]}\n"
    )
    return "".join(lines)


def _render_craftax_format(sem: Semantic, kind: str) -> list[str]:
    n = sem.block.shape[0]
    tiles = _craftax_tile_table(kind)[_tile_code(sem, kind)]  # (N, T) of "desc\n"
    prefixes = _craftax_prefixes(kind)
    t = prefixes.shape[0]
    grid = np.empty((n, 2 * t + 1), dtype=object)
    grid[:, 0] = "Map:\n"
    grid[:, 1::2] = prefixes
    grid[:, 2::2] = tiles
    tail = _craftax_tail if kind == "craftax" else _classic_tail
    # .tolist() turns float32 into the Python float of the same value: craftax prints f"{jax scalar}",
    # which formats that Python float (e.g. "0.9991665482521057"), not numpy's float32 repr
    cols = zip(
        sem.inventory.tolist(), sem.stats.tolist(), sem.health.tolist(), sem.light_level.tolist(),
        sem.direction.tolist(), sem.floor.tolist(), sem.flags.tolist(), sem.enchant.tolist(),
    )  # fmt: skip
    return ["".join(row) + tail(*c) for row, c in zip(grid.tolist(), cols)]


# ---------------------------------------------------------------------------------------------
# compact format

_BACKGROUND = {
    "craftax": ("invalid", "out_of_bounds", "grass", "sand", "path", "darkness", "fire_grass", "ice_grass",
                "gravel"),
    "craftax-classic": ("invalid", "out_of_bounds", "grass", "sand", "path"),
}  # fmt: skip
_MAX_VALUE = 256  # value tables cover 0..255; inventory is capped at 99 in both games


class _Pieces:
    """(env, order, text) triples gathered from several vectorised sources; joined per env at the end."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.env: list[np.ndarray] = []
        self.order: list[np.ndarray] = []
        self.text: list[np.ndarray] = []

    def add(self, env: np.ndarray, order: np.ndarray, text: np.ndarray) -> None:
        self.env.append(np.asarray(env, np.int64))
        self.order.append(np.asarray(order, np.int64))
        self.text.append(np.asarray(text, dtype=object))

    def dense(self, order0: int, text: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Add an (N, P) matrix of pieces; column j gets order order0 + j; `mask` picks the present ones."""
        text = np.asarray(text, dtype=object).reshape(self.num_envs, -1)
        if mask is None:
            self.add(np.repeat(np.arange(self.num_envs), text.shape[1]),
                     np.tile(order0 + np.arange(text.shape[1]), self.num_envs), text.ravel())  # fmt: skip
            return
        e, j = np.nonzero(np.asarray(mask).reshape(text.shape))
        self.add(e, order0 + j, text[e, j])

    def ordered(self) -> tuple[list[str], list[int]]:
        """All pieces in output order, and the bounds of each env's run in that list."""
        env, order, text = (np.concatenate(x) for x in (self.env, self.order, self.text))
        idx = np.argsort(env * (1 << 20) + order, kind="stable")  # orders are < 2**20
        bounds = np.searchsorted(env[idx], np.arange(self.num_envs + 1)).tolist()
        return text[idx].tolist(), bounds

    def join(self) -> list[str]:
        text_l, bounds = self.ordered()
        return ["".join(text_l[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _signed(v: int) -> str:
    return f"+{v}" if v > 0 else str(v)


@functools.lru_cache(maxsize=None)
def _compact_tables(kind: str) -> dict[str, Any]:
    rows, cols = N.VIEW_SHAPE[kind]
    r = np.repeat(np.arange(rows) - rows // 2, cols)
    c = np.tile(np.arange(cols) - cols // 2, rows)
    t = rows * cols
    mobs = [m.lower() for m in N.MOB_NAMES[kind]]
    items = [i.replace("_", " ") for i in N.ITEM_NAMES]
    blocks = [b.replace("_", " ") for b in N.BLOCK_NAMES[kind]]
    things = mobs + items + blocks  # thing id = mob | n_mobs + item | n_mobs + n_items + block
    bg = np.zeros(len(N.BLOCK_NAMES[kind]), bool)
    bg[[N.BLOCK_NAMES[kind].index(b) for b in _BACKGROUND[kind]]] = True
    facing_name = [" darkness"] + [
        " " + (mobs[m] if m >= 0 else items[i] if i > 0 else blocks[b])
        for m in range(-1, len(mobs)) for i in range(len(items)) for b in range(len(blocks))
    ]  # fmt: skip  -- indexed by _tile_code
    inv_fields = N.INVENTORY_FIELDS[kind]
    inv = np.empty((len(inv_fields), _MAX_VALUE), dtype=object)
    for k, f in enumerate(inv_fields):
        for v in range(_MAX_VALUE):
            inv[k, v] = _inventory_piece(kind, f, v)
    return {
        "dist_key": (np.abs(r) + np.abs(c)) * t + np.arange(t),  # nearest first, then reading order
        "coord": np.array([f" ({_signed(a)},{_signed(b)})" for a, b in zip(r, c)], dtype=object),
        "thing": np.array(["\n" + s for s in things], dtype=object),
        "count": np.array([""] * (COMPACT_MAX_TILES + 1) + [f" x{k}" for k in range(COMPACT_MAX_TILES + 1, t + 1)],
                          dtype=object),  # fmt: skip
        "n_mobs": len(mobs),
        "n_items": len(items),
        "bg": bg,
        "facing": np.array(facing_name, dtype=object),
        "inv_first": np.array([[" " + s if s else s for s in row] for row in inv], dtype=object),
        "inv_rest": np.array([[", " + s if s else s for s in row] for row in inv], dtype=object),
        "num": np.array([str(v) for v in range(_MAX_VALUE)], dtype=object),
        "centre": (rows // 2) * cols + cols // 2,
        "cols": cols,
    }


_LEVEL_MATERIAL = {1: "wood", 2: "stone", 3: "iron", 4: "diamond"}
_ARMOUR_MATERIAL = {1: "iron", 2: "diamond"}


def _inventory_piece(kind: str, field: str, v: int) -> str:
    """Compact text of one inventory entry with value v ('' when absent)."""
    if v <= 0:
        return ""
    if kind == "craftax":
        if field in ("pickaxe", "sword"):
            return f"{_LEVEL_MATERIAL.get(v, v)} {field}"
        if field == "bow":
            return "bow"
        if field in ("helmet", "chestplate", "leggings", "boots"):
            return f"{_ARMOUR_MATERIAL.get(v, v)} {field}"
        if field.startswith("potion_"):
            return f"{field[7:]} potion {v}"
        if field == "torches":
            return f"torch {v}"
        if field in ("arrows", "books"):
            return f"{field[:-1]} {v}"
    elif "_pickaxe" in field or "_sword" in field:
        return field.replace("_", " ") if v == 1 else f"{field.replace('_', ' ')} {v}"
    return f"{field} {v}"


def _light_word(light: np.ndarray) -> np.ndarray:
    return np.where(light >= 0.6, "day", np.where(light >= 0.3, "dusk", "night")).astype(object)


def _render_compact(sem: Semantic, kind: str) -> list[str]:
    return _compact_pieces(sem, kind).join()


def _compact_pieces(sem: Semantic, kind: str) -> _Pieces:
    """Every env's compact pieces, in four sections ordered by their order keys: the first line (0..),
    the map (100..), the inventory (20_000..), vitals and flags (30_000..)."""
    tb = _compact_tables(kind)
    p = _Pieces(sem.block.shape[0])
    _compact_first_line(p, sem, kind, tb)
    _compact_map(p, sem, tb)
    _compact_inventory(p, sem, kind, tb)
    _compact_vitals(p, sem, kind, tb)
    return p


def _compact_first_line(p: _Pieces, sem: Semantic, kind: str, tb: dict[str, Any]) -> None:
    """ "floor 0 overworld, day, facing north: tree" (Craftax below ground: no daylight; Classic: no floor)."""
    n = sem.block.shape[0]
    code = _tile_code(sem, kind)
    light_word = _light_word(sem.light_level)
    if kind == "craftax":
        floor = sem.floor.astype(np.int64)
        head = np.array([f"floor {f} {N.FLOOR_NAMES[f]}" for f in range(len(N.FLOOR_NAMES))], dtype=object)
        p.dense(0, head[floor])
        light_word = ", " + light_word
    # daylight matters on the surface only
    p.dense(1, light_word, sem.floor == 0)
    d = sem.direction.astype(np.int64)
    dr = np.array([x[0] for x in N.DIRECTION_DELTAS])[d]
    dc = np.array([x[1] for x in N.DIRECTION_DELTAS])[d]
    facing_t = tb["centre"] + dr * tb["cols"] + dc
    compass = np.array([f", facing {c}:" for c in N.COMPASS], dtype=object)
    p.dense(2, compass[d])
    p.dense(3, tb["facing"][code[np.arange(n), facing_t]])


def _compact_map(p: _Pieces, sem: Semantic, tb: dict[str, Any]) -> None:
    """Every lit non-background thing, grouped by kind, nearest first; then the number of dark tiles."""
    n = sem.block.shape[0]
    t = sem.block.shape[1] * sem.block.shape[2]
    block = sem.block.reshape(n, t).astype(np.int64)
    item = sem.item.reshape(n, t).astype(np.int64)
    mob = sem.mob.reshape(n, t).astype(np.int64)
    lit = sem.light.reshape(n, t)
    n_mobs, n_items = tb["n_mobs"], tb["n_items"]
    masks = (lit & (mob >= 0), lit & (item > 0), lit & ~tb["bg"][block])
    ids = (mob, n_mobs + item, n_mobs + n_items + block)
    envs, things, keys = [], [], []
    for m, thing in zip(masks, ids):
        e, j = np.nonzero(m)
        envs.append(e)
        things.append(thing[e, j])
        keys.append(j)
    e, th, j = np.concatenate(envs), np.concatenate(things), np.concatenate(keys)
    if e.size:
        n_things = len(tb["thing"])
        dist = tb["dist_key"][j]
        group = e * n_things + th
        order = np.argsort(group * 1024 + dist, kind="stable")  # dist_key < 1024 for both views
        group, j, e, th = group[order], j[order], e[order], th[order]
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        counts = np.diff(np.r_[starts, group.size])
        rank = np.arange(group.size) - np.repeat(starts, counts)
        keep = rank < COMPACT_MAX_TILES
        base = 100 + th * 16
        p.add(e[starts], base[starts], tb["thing"][th[starts]])
        p.add(e[starts], base[starts] + 1, tb["count"][counts])
        p.add(e[keep], base[keep] + 2 + rank[keep], tb["coord"][j[keep]])
    num_dark = (~lit).sum(1)
    dark = np.array(["", *[f"\ndark tiles: {k}" for k in range(1, t + 1)]], dtype=object)
    p.dense(10_000, dark[num_dark], num_dark > 0)


def _compact_inventory(p: _Pieces, sem: Semantic, kind: str, tb: dict[str, Any]) -> None:
    """Only what is there (craftax: enchantments right after their item), or "nothing"."""
    n = sem.block.shape[0]
    inv = np.clip(sem.inventory.astype(np.int64), 0, _MAX_VALUE - 1)
    k_idx = np.arange(inv.shape[1])[None, :]
    present = inv > 0
    first = present & (np.cumsum(present, 1) == 1)
    pieces = np.where(first, tb["inv_first"][k_idx, inv], tb["inv_rest"][k_idx, inv])
    p.dense(20_000, np.full((n, 1), "\ninventory:", dtype=object))
    # column k at order 20_001 + 2k; an enchantment right after its item at 20_002 + 2k
    e, j = np.nonzero(present)
    p.add(e, 20_001 + 2 * j, pieces[e, j])
    p.dense(20_100, np.full((n, 1), " nothing", dtype=object), ~present.any(1, keepdims=True))
    if kind == "craftax":
        # " of fire", not " (fire)": a piece ending in punctuation would merge with the next ","
        # in GPT-2 style pre-tokenizers, and CompactTokenRenderer relies on piece boundaries
        ench_name = np.array(["", " of fire", " of ice"], dtype=object)
        ench = np.clip(sem.enchant.astype(np.int64), 0, 2)
        fields = N.INVENTORY_FIELDS["craftax"]
        for e_col, field in enumerate(N.ENCHANT_FIELDS):
            col = fields.index(field)
            e_idx = np.flatnonzero(present[:, col] & (ench[:, e_col] > 0))
            p.add(e_idx, np.full(e_idx.size, 20_002 + 2 * col), ench_name[ench[e_idx, e_col]])


def _compact_vitals(p: _Pieces, sem: Semantic, kind: str, tb: dict[str, Any]) -> None:
    """Health, food, drink, energy (mana); xp and attributes once they mean something; flags that apply."""
    n = sem.block.shape[0]
    num = tb["num"]
    health = np.clip(np.ceil(sem.health), 0, _MAX_VALUE - 1).astype(np.int64)
    stats = np.clip(sem.stats.astype(np.int64), 0, _MAX_VALUE - 1)
    stat_names = N.STAT_FIELDS[kind]
    p.dense(30_000, ("\nhealth " + num[health]).reshape(n, 1))
    shown = ("food", "drink", "energy", "mana")
    for k, name in enumerate(stat_names):
        label = np.array([f", {name} "], dtype=object)
        if name in shown:
            p.dense(30_001 + k, (label + num[stats[:, k]]).reshape(n, 1))
        else:  # xp and attributes only once they mean something
            more = stats[:, k] > (0 if name == "xp" else 1)
            p.dense(30_001 + k, (label + num[stats[:, k]]).reshape(n, 1), more[:, None])
    flag_text = {
        "is_sleeping": ", sleeping", "is_resting": ", resting", "learned_fireball": ", knows fireball",
        "learned_iceball": ", knows iceball", "ladder_open": ", ladder open",
        "boss_vulnerable": ", boss vulnerable",
    }  # fmt: skip
    flag_names = N.FLAG_FIELDS[kind]
    for k, name in enumerate(flag_names):
        if name in flag_text:
            mask = sem.flags[:, k].astype(bool)
            if name == "ladder_open":  # the overworld's ladder is always open: say it below ground only
                mask = mask & (sem.floor > 0)
            if name == "boss_vulnerable":  # only the last floor has the boss
                mask = mask & (sem.floor == len(N.FLOOR_NAMES) - 1)
            p.dense(30_100 + k, np.full((n, 1), flag_text[name], dtype=object), mask[:, None])


class CompactTokenRenderer:
    """Compact text straight to token ids: every piece is tokenized once and cached, and an env's ids
    are the concatenation of its pieces' ids.

    Equal to `tokenizer(text, add_special_tokens=False)` for byte-level BPE tokenizers with the GPT-2
    pre-tokenizer (SmolLM2, Qwen, Llama 3 style): no compact piece ends with a space, so every piece
    boundary is a pre-token boundary and BPE never merges across it. The tests check the equality.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}

    def _lookup(self, pieces: list[str]) -> list[list[int]]:
        new = [p for p in set(pieces) if p not in self._ids]
        if new:
            for p, ids in zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]):
                self._ids[p] = list(ids)
        ids = self._ids
        return [ids[p] for p in pieces]

    def render(self, sem: Semantic, env_kind: str | None = None) -> list[list[int]]:
        found = kind_of_semantic(sem)
        if env_kind is not None and craftax_envs.env_kind(env_kind) != found:
            raise UserError(f"render(env_kind={env_kind!r}) got the semantics of a {found!r} state")
        pieces, bounds = _compact_pieces(_as_numpy(sem), found).ordered()
        piece_ids = self._lookup(pieces)
        return [[t for ids in piece_ids[a:b] for t in ids] for a, b in zip(bounds[:-1], bounds[1:])]
