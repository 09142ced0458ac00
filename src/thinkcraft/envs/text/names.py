"""Name tables for Craftax and Craftax-Classic, built once from craftax's own enums.

Everything the renderers print comes from here, so that a new craftax version that renames a
block shows up as a failing equivalence test rather than silently different text.
"""

from __future__ import annotations

from craftax.craftax import constants as C
from craftax.craftax_classic import constants as CC

# Per env kind ("craftax", "craftax-classic": envs.craftax.ENV_KINDS; `envs.craftax.env_kind` maps env
# names and aliases to them).

# view sizes (rows, cols): the player sits at the centre
VIEW_SHAPE: dict[str, tuple[int, int]] = {
    "craftax": tuple(C.OBS_DIM),
    "craftax-classic": tuple(CC.OBS_DIM),
}

BLOCK_NAMES: dict[str, tuple[str, ...]] = {
    "craftax": tuple(b.name.lower() for b in C.BlockType),
    "craftax-classic": tuple(b.name.lower() for b in CC.BlockType),
}
ITEM_NAMES: tuple[str, ...] = tuple(i.name.lower() for i in C.ItemType)

# Craftax mob identifiers are class * 8 + type_id (class order = render_craftax_text's scan order:
# melee, passive, ranged, mob projectiles, player projectiles); names exactly as craftax prints them.
MOB_TYPES_PER_CLASS = 8
_CRAFTAX_MOB_NAMES = {
    0: "Zombie", 1: "Gnome Warrior", 2: "Orc Soldier", 3: "Lizard", 4: "Knight", 5: "Troll",
    6: "Pigman", 7: "Frost Troll", 8: "Cow", 9: "Bat", 10: "Snail", 16: "Skeleton",
    17: "Gnome Archer", 18: "Orc Mage", 19: "Kobold", 20: "Archer", 21: "Deep Thing",
    22: "Fire Elemental", 23: "Ice Elemental", 24: "Arrow", 25: "Dagger", 26: "Fireball",
    27: "Iceball", 28: "Arrow", 29: "Slimeball", 30: "Fireball", 31: "Iceball",
    32: "Arrow (Player)", 33: "Dagger (Player)", 34: "Fireball (Player)", 35: "Iceball (Player)",
    36: "Arrow (Player)", 37: "Slimeball (Player)", 38: "Fireball (Player)", 39: "Iceball (Player)",
}  # fmt: skip
# identifiers craftax never produces print as "None" there (mob_id_to_name falls through)
MOB_NAMES: dict[str, tuple[str, ...]] = {
    "craftax": tuple(_CRAFTAX_MOB_NAMES.get(i, "None") for i in range(5 * MOB_TYPES_PER_CLASS)),
    # Classic's symbolic obs has 4 mob channels in this order (renderer.render_craftax_symbolic)
    "craftax-classic": ("Zombie", "Cow", "Skeleton", "Arrow"),
}

# player_direction holds an Action value: 1 left (west), 2 right (east), 3 up (north), 4 down (south)
DIRECTION_NAMES = ("noop", "left", "right", "up", "down")
COMPASS = ("none", "west", "east", "north", "south")
# (row, col) step per direction, as craftax.constants.DIRECTIONS
DIRECTION_DELTAS = ((0, 0), (0, -1), (0, 1), (-1, 0), (1, 0))

ACTION_NAMES: dict[str, tuple[str, ...]] = {
    "craftax": tuple(a.name.lower() for a in C.Action),
    "craftax-classic": tuple(a.name.lower() for a in CC.Action),
}

# Inventory columns of Semantic.inventory, in this order (craftax's text order first)
INVENTORY_FIELDS: dict[str, tuple[str, ...]] = {
    "craftax": (
        "wood", "stone", "coal", "iron", "diamond", "sapphire", "ruby", "sapling", "torches",
        "arrows", "books", "pickaxe", "sword", "bow",
        "potion_red", "potion_green", "potion_blue", "potion_pink", "potion_cyan", "potion_yellow",
        "helmet", "chestplate", "leggings", "boots",
    ),
    "craftax-classic": (
        "wood", "stone", "coal", "iron", "diamond", "sapling", "wood_pickaxe", "stone_pickaxe",
        "iron_pickaxe", "wood_sword", "stone_sword", "iron_sword",
    ),
}  # fmt: skip

# Integer stats of Semantic.stats, in this order (health and light are floats, kept apart)
STAT_FIELDS: dict[str, tuple[str, ...]] = {
    "craftax": ("food", "drink", "energy", "mana", "xp", "dexterity", "strength", "intelligence"),
    "craftax-classic": ("food", "drink", "energy"),
}
# Boolean flags of Semantic.flags
FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "craftax": ("is_sleeping", "is_resting", "learned_fireball", "learned_iceball", "ladder_open",
                "boss_vulnerable"),
    "craftax-classic": ("is_sleeping",),
}  # fmt: skip
# Enchantment levels of Semantic.enchant (craftax only): sword, bow, helmet, chestplate, leggings, boots
ENCHANT_FIELDS = ("sword", "bow", "helmet", "chestplate", "leggings", "boots")

FLOOR_NAMES = (
    "overworld", "dungeon", "gnomish mines", "sewers", "vaults", "troll mines", "fire realm",
    "ice realm", "graveyard",
)  # fmt: skip
