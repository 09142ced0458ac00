"""`thinkcraft render`: print the text observations of a short rollout (for prompt work).

Uniformly random actions seldom change a Craftax frame (most of the 43 actions are crafts that fail, and
a move is one in ten), so by default the player follows a scripted walk (`ExploreWalk`): it interacts with
what it faces and can use (chops, mines with the pickaxe it needs, drinks when thirsty, hits), tries a
craft now and then, and otherwise walks on, turning at obstacles. Each printed frame names the actions
taken since the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from thinkcraft.envs.craftax import env_kind
from thinkcraft.envs.text.names import ACTION_NAMES, BLOCK_NAMES, DIRECTION_DELTAS, INVENTORY_FIELDS, STAT_FIELDS
from thinkcraft.envs.text.render import COMPACT_FORMAT_DOC, FORMATS
from thinkcraft.utils.errors import ConfigError, UserError, check


@dataclass
class RenderConfig:
    env: str = "craftax"
    """Craftax-Symbolic-v1 / Craftax-Classic-Symbolic-v1, or the aliases craftax / craftax-classic."""
    format: str = "compact"
    """Text format: compact (short, for LLMs) or craftax (craftax's own layout, ~1,750 characters)."""
    seed: int = 0
    """Seed of the worlds and of the actions."""
    steps: int = 20
    """Steps to take; prints the observation before the first step and after each (see --every)."""
    policy: Literal["explore", "random"] = "explore"
    """explore: a scripted walk that interacts with what it faces and walks on (frames change);
    random: uniformly random actions (most do nothing visible)."""
    num_envs: int = 1
    """Envs rolled out side by side (each printed)."""
    every: int = 1
    """Print every this many steps."""
    show_doc: bool = False
    """Print the compact format's convention (COMPACT_FORMAT_DOC) first."""

    def __post_init__(self) -> None:
        try:
            env_kind(self.env)
        except UserError as e:
            raise ConfigError("env", str(e)) from None
        check(self.format in FORMATS, "format", f"unknown format {self.format!r}; valid: {', '.join(FORMATS)}")
        check(self.policy in ("explore", "random"), "policy", f"explore or random, got {self.policy!r}")
        check(self.steps >= 0, "steps", f"must be >= 0, got {self.steps}")
        check(1 <= self.num_envs <= 4096, "num_envs", f"must be in 1..4096, got {self.num_envs}")
        check(self.every >= 1, "every", f"must be >= 1, got {self.every}")


# blocks the walk interacts with ("do": collect, mine, open, drink when thirsty), with the pickaxe level
# mining needs (1 wood, 2 stone, 3 iron: craftax's game logic); `do` without it changes nothing
INTERACT_BLOCKS: dict[str, int] = {
    "tree": 0, "ripe_plant": 0, "chest": 0, "fountain": 0, "fire_tree": 0, "ice_shrub": 0, "water": 0,
    "stone": 1, "coal": 1, "iron": 2, "diamond": 3, "sapphire": 3, "ruby": 3,
}  # fmt: skip
WALK_BLOCKS = frozenset({"grass", "sand", "path", "fire_grass", "ice_grass", "gravel"})
# tried now and then; each succeeds only when the inventory (and a nearby table) allows it
CRAFT_ACTIONS = ("place_table", "make_wood_pickaxe", "make_wood_sword", "place_stone", "make_stone_pickaxe",
                 "place_furnace", "place_plant")
MAX_DRINK = 9


def pickaxe_level(kind: str, inventory: np.ndarray) -> np.ndarray:
    """(N,) best pickaxe per env: 0 none, 1 wood, 2 stone, 3 iron, 4 diamond (Craftax stores the level)."""
    fields = INVENTORY_FIELDS[kind]
    if "pickaxe" in fields:
        return inventory[:, fields.index("pickaxe")].astype(np.int64)
    has = [inventory[:, fields.index(f"{m}_pickaxe")] > 0 for m in ("wood", "stone", "iron")]
    return np.select(has[::-1], [3, 2, 1], 0)


@dataclass
class ExploreWalk:
    """A scripted walk that visibly plays, per env: face a mob, or an INTERACT block it can use (the
    pickaxe it needs; water when thirsty) -> `do` (at most `max_dos` times in a row, then it turns);
    else with probability `craft_p` a CRAFT_ACTIONS entry; else walk on (the player's direction) when the
    tile ahead is walkable and no turn was drawn (`turn_p`), otherwise turn to one of the other three."""

    kind: str
    seed: int = 0
    max_dos: int = 3
    craft_p: float = 0.1
    turn_p: float = 0.15
    _rng: np.random.Generator = field(init=False, repr=False)
    _dos: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        names = BLOCK_NAMES[self.kind]
        # pickaxe level needed per block id; above any level for blocks it does not interact with
        self._needs = np.array([INTERACT_BLOCKS.get(n, 99) for n in names])
        self._water = names.index("water")
        self._walk = np.array([n in WALK_BLOCKS for n in names])
        acts = ACTION_NAMES[self.kind]
        self._do = acts.index("do")
        self._crafts = np.array([acts.index(a) for a in CRAFT_ACTIONS])

    def __call__(self, step: int, states: Any) -> np.ndarray:
        import jax

        from thinkcraft.envs.text import extract

        sem = jax.device_get(extract(states))
        drink = np.asarray(sem.stats)[:, STAT_FIELDS[self.kind].index("drink")]
        return self.choose(np.asarray(sem.block), np.asarray(sem.mob), np.asarray(sem.direction),
                           pickaxe_level(self.kind, np.asarray(sem.inventory)), drink)

    def choose(self, block: np.ndarray, mob: np.ndarray, direction: np.ndarray,
               pickaxe: np.ndarray | None = None, drink: np.ndarray | None = None) -> np.ndarray:
        """Actions for views `block`/`mob` (N, rows, cols; player at the centre), directions (N,) 1..4,
        pickaxe levels (N,) (default none) and drink (N,) (default full)."""
        n, rows, cols = block.shape
        pickaxe = np.zeros(n, np.int64) if pickaxe is None else pickaxe
        drink = np.full(n, MAX_DRINK) if drink is None else drink
        if self._dos is None or self._dos.shape != (n,):
            self._dos = np.zeros(n, np.int64)
        delta = np.asarray(DIRECTION_DELTAS)[direction]
        r, c = rows // 2 + delta[:, 0], cols // 2 + delta[:, 1]
        ahead_block, ahead_mob = block[np.arange(n), r, c], mob[np.arange(n), r, c]
        usable = (self._needs[ahead_block] <= pickaxe) & ((ahead_block != self._water) | (drink < MAX_DRINK))
        interact = (usable | (ahead_mob >= 0)) & (self._dos < self.max_dos)
        craft = ~interact & (self._rng.random(n) < self.craft_p)
        walk_on = ~interact & ~craft & self._walk[ahead_block] & (self._rng.random(n) >= self.turn_p)
        other_dir = (direction - 1 + self._rng.integers(1, 4, n)) % 4 + 1  # one of the other three
        actions = np.where(walk_on, direction, other_dir)
        actions = np.where(craft, self._crafts[self._rng.integers(0, len(self._crafts), n)], actions)
        actions = np.where(interact, self._do, actions)
        self._dos = np.where(interact, self._dos + 1, 0)
        return actions.astype(np.int32)


@dataclass
class UniformActions:
    """Uniformly random actions (what `random_rollout` draws), on the host so that render can name them."""

    kind: str
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, step: int, states: Any) -> np.ndarray:
        import jax

        n = jax.tree_util.tree_leaves(states)[0].shape[0]
        return self._rng.integers(0, len(ACTION_NAMES[self.kind]), n).astype(np.int32)


def frame_header(step: int, env: int | None, actions: list[str]) -> str:
    """`=== step 3, env 1, after: right, do ===` (no env for a single env, no actions at step 0)."""
    return (f"=== step {step}" + (f", env {env}" if env is not None else "")
            + (f", after: {', '.join(actions)}" if actions else "") + " ===")


def run(cfg: RenderConfig) -> int:
    import jax

    from thinkcraft.envs.text import extract, render
    from thinkcraft.envs.text.rollout import random_rollout

    kind = env_kind(cfg.env)
    if cfg.show_doc:
        print(COMPACT_FORMAT_DOC + "\n")
    policy = (ExploreWalk if cfg.policy == "explore" else UniformActions)(kind, seed=cfg.seed)
    taken: list[np.ndarray] = []  # actions since the last printed frame, one (num_envs,) array per step

    def act(step: int, states: Any) -> np.ndarray:
        taken.append(policy(step, states))
        return taken[-1]

    names = ACTION_NAMES[kind]
    for step, states in random_rollout(kind, cfg.num_envs, cfg.steps, seed=cfg.seed, every=cfg.every, policy=act):
        texts = render(jax.device_get(extract(states)), cfg.format, env_kind=kind)
        for i, text in enumerate(texts):
            print(frame_header(step, i if cfg.num_envs > 1 else None, [names[a[i]] for a in taken]))
            print(text.rstrip("\n"))
        taken.clear()
    return 0
