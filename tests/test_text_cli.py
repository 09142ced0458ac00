"""`thinkcraft render`: a short rollout prints text and the actions between frames; the default scripted
walk visibly plays; bad env/format names are one clean error."""

from __future__ import annotations

import numpy as np
import pytest

from thinkcraft.cli import main
from thinkcraft.envs.text.cli import ExploreWalk, RenderConfig, frame_header
from thinkcraft.envs.text.names import ACTION_NAMES, BLOCK_NAMES
from thinkcraft.utils.errors import ConfigError

CLASSIC_BLOCKS = BLOCK_NAMES["craftax-classic"]
CLASSIC_ACTIONS = ACTION_NAMES["craftax-classic"]


def classic_view(ahead: str, n: int = 1, mob_ahead: bool = False):
    """Classic views (n, 7, 9) of grass with `ahead` north of the player (centre 3, 4), facing north."""
    block = np.full((n, 7, 9), CLASSIC_BLOCKS.index("grass"), np.uint8)
    block[:, 2, 4] = CLASSIC_BLOCKS.index(ahead)
    mob = np.full((n, 7, 9), -1, np.int8)
    if mob_ahead:
        mob[:, 2, 4] = 1  # a cow
    return block, mob, np.full(n, 3, np.int8)


def test_explore_walk_interacts_then_moves_on():
    walk = ExploreWalk("craftax-classic", seed=0, craft_p=0.0, turn_p=0.0)
    names = lambda a: [CLASSIC_ACTIONS[i] for i in a]  # noqa: E731
    # a tree ahead: `do` max_dos times in a row, then a turn (one of the other three directions)
    tree = classic_view("tree", n=4)
    assert [names(walk.choose(*tree)) for _ in range(3)] == [["do"] * 4] * 3
    assert set(names(walk.choose(*tree))) <= {"left", "right", "down"}
    # grass ahead and no turn drawn: walk on; lava or a table ahead: never step on, turn
    assert names(walk.choose(*classic_view("grass", n=4))) == ["up"] * 4
    for blocked in ("lava", "crafting_table"):
        assert set(names(walk.choose(*classic_view(blocked, n=8)))) <= {"left", "right", "down"}
    # stone: mined only with a pickaxe; water: drunk only when thirsty
    fresh = lambda: ExploreWalk("craftax-classic", seed=2, craft_p=0.0)  # noqa: E731
    stone, water = classic_view("stone", n=2), classic_view("water", n=2)
    no_pick, mined = names(fresh().choose(*stone, pickaxe=np.array([0, 1])))
    assert no_pick in {"left", "right", "down"} and mined == "do"
    full, thirsty = names(fresh().choose(*water, drink=np.array([9, 8])))
    assert full in {"left", "right", "down"} and thirsty == "do"
    # a mob ahead: hit it
    assert names(walk.choose(*classic_view("grass", n=2, mob_ahead=True))) == ["do", "do"]
    # with craft_p = 1 on open ground every action is a craft/place attempt
    crafty = ExploreWalk("craftax-classic", seed=1, craft_p=1.0)
    assert all(a.startswith(("place_", "make_")) for a in names(crafty.choose(*classic_view("grass", n=16))))


def test_pickaxe_level_of_both_inventories():
    from thinkcraft.envs.text.cli import pickaxe_level
    from thinkcraft.envs.text.names import INVENTORY_FIELDS

    inv = np.zeros((4, len(INVENTORY_FIELDS["craftax-classic"])), np.int16)
    for row, tools in enumerate([(), ("wood",), ("wood", "stone"), ("iron",)]):
        for t in tools:
            inv[row, INVENTORY_FIELDS["craftax-classic"].index(f"{t}_pickaxe")] = 1
    assert pickaxe_level("craftax-classic", inv).tolist() == [0, 1, 2, 3]
    inv = np.zeros((2, len(INVENTORY_FIELDS["craftax"])), np.int16)
    inv[1, INVENTORY_FIELDS["craftax"].index("pickaxe")] = 4
    assert pickaxe_level("craftax", inv).tolist() == [0, 4]


def test_frame_header_names_the_actions_since_the_last_frame():
    assert frame_header(0, None, []) == "=== step 0 ==="
    assert frame_header(4, 1, ["up", "do"]) == "=== step 4, env 1, after: up, do ==="


def test_bad_names_list_valid_ones(capsys):
    assert main(["render", "--env", "minecraft"]) == 2
    err = capsys.readouterr().err
    assert "minecraft" in err and "Craftax-Classic-Symbolic-v1" in err and "Traceback" not in err
    assert main(["render", "--format", "xml"]) == 2
    err = capsys.readouterr().err
    assert "compact, craftax" in err
    with pytest.raises(ConfigError, match="steps"):
        RenderConfig(steps=-1)


@pytest.mark.slow
def test_render_prints_rollout(capsys):
    # 8 envs: the same compiled reset/step as test_text_craftax's rollouts
    assert main(["render", "--env", "Craftax-Symbolic-v1", "--num-envs", "8", "--steps", "2", "--show-doc"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Observation format.")
    assert out.count("=== step ") == 3 * 8 and "=== step 2, env 7, after: " in out
    assert out.count("floor 0 overworld") == 3 * 8 and out.count("\nhealth ") == 3 * 8
    assert main(["render", "--env", "craftax", "--num-envs", "8", "--steps", "0", "--format", "craftax"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nIs Boss Vulnerable: ") == 8 and out.count("Map:\n-5, -4: ") == 8


@pytest.mark.slow
def test_render_default_walk_visibly_plays(capsys):
    # 8 envs: the compiled reset/step of the test above; most of env 0's frames differ, each names its action
    assert main(["render", "--env", "craftax", "--num-envs", "8", "--steps", "12", "--seed", "1"]) == 0
    frames = [f for f in capsys.readouterr().out.split("=== step ")[1:] if f.split(" ===")[0].split(", ")[1:2] == ["env 0"]]
    assert len(frames) == 13
    headers = [f.splitlines()[0] for f in frames]
    assert headers[0] == "0, env 0 ===" and all(", after: " in h for h in headers[1:])
    bodies = ["\n".join(f.splitlines()[1:]) for f in frames]
    changed = sum(a != b for a, b in zip(bodies, bodies[1:]))
    assert changed >= 8, f"only {changed} of 12 steps changed env 0's frame"
