"""`thinkcraft render`: a short rollout prints text; bad env/format names are one clean error."""

from __future__ import annotations

import pytest

from thinkcraft.cli import main
from thinkcraft.envs.text.cli import RenderConfig
from thinkcraft.utils.errors import ConfigError


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
    assert out.count("=== step ") == 3 * 8 and "=== step 2, env 7 ===" in out
    assert out.count("floor 0 overworld") == 3 * 8 and out.count("\nhealth ") == 3 * 8
    assert main(["render", "--env", "craftax", "--num-envs", "8", "--steps", "0", "--format", "craftax"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nIs Boss Vulnerable: ") == 8 and out.count("Map:\n-5, -4: ") == 8
