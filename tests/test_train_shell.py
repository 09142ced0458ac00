"""The training shell shared by `train ppo`, `train ppo-hidden` and `train llm-policy` (issue 17 items 1-3):
verified checkpoints, run directories never silently reused, resume from the saved config, SIGTERM = Ctrl-C.
Nothing here compiles Craftax or loads a model (the end-to-end runs are in test_train_ppo / test_llm_policy)."""

import json
import numpy as np
import pytest

from thinkcraft.cli import main
from thinkcraft.train.checkpoint import (
    JAX_CODEC, TORCH_CODEC, CheckpointError, commit_checkpoint, latest_meta, load_params, read_checkpoint,
)
from thinkcraft.train.session import TrainSession

STATE = {"w": np.arange(64, dtype=np.float32), "step": np.int32(0)}


def _commit(run_dir, update, codec=JAX_CODEC, keep=2):
    state = {"w": STATE["w"] + update, "step": np.int32(update)}
    files = codec.encode(state, {"w": state["w"]} if codec is JAX_CODEC else None)
    return commit_checkpoint(run_dir, files, {"update": update, "env_steps": 128 * update}, keep=keep)


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF  # same size, different bytes
    p.write_bytes(bytes(b))


# (what breaks, how, which file the error must name, the update --resume-fallback lands on)
CORRUPTIONS = [
    ("state truncated", lambda ck: _truncate(ck / "00000002" / "state.msgpack"), "00000002/state.msgpack", 1),
    ("state missing", lambda ck: (ck / "00000002" / "state.msgpack").unlink(), "00000002/state.msgpack", 1),
    ("params flipped", lambda ck: _flip(ck / "00000002" / "params.msgpack"), "00000002/params.msgpack", 1),
    ("latest.json truncated", lambda ck: _truncate(ck / "latest.json"), "checkpoint/latest.json", 2),
    ("latest.json missing", lambda ck: (ck / "latest.json").unlink(), "checkpoint/latest.json", 2),
    ("directory missing", lambda ck: __import__("shutil").rmtree(ck / "00000002"), "checkpoint/latest.json", 1),
]


@pytest.mark.parametrize("what,corrupt,named,fallback_update", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_a_damaged_checkpoint_is_one_error_naming_the_file_and_fallback_finds_a_good_one(
        tmp_path, what, corrupt, named, fallback_update):
    _commit(tmp_path, 1)
    _commit(tmp_path, 2)
    cp, problems = read_checkpoint(tmp_path)
    assert cp.update == 2 and problems == []
    corrupt(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)
    msg = str(e.value)
    assert named in msg and "--resume-fallback" in msg and "\n" not in msg
    cp, problems = read_checkpoint(tmp_path, fallback=True)
    assert cp.update == fallback_update and problems and named in problems[0]
    state = JAX_CODEC.decode(cp.files, STATE)
    assert np.array_equal(state["w"], STATE["w"] + fallback_update)


def test_no_good_checkpoint_left_is_an_error_and_load_params_verifies(tmp_path):
    _commit(tmp_path, 1, keep=1)
    _flip(tmp_path / "checkpoint" / "00000001" / "state.msgpack")
    with pytest.raises(CheckpointError, match="state.msgpack is corrupt") as e:
        read_checkpoint(tmp_path)
    assert "--resume-fallback" not in str(e.value)  # nothing to fall back to
    with pytest.raises(CheckpointError, match="no other checkpoint"):
        read_checkpoint(tmp_path, fallback=True)
    # eval/collect read the parameters alone: verified too
    assert np.array_equal(load_params(tmp_path, {"w": np.zeros(64, np.float32)})["w"], STATE["w"] + 1)
    _truncate(tmp_path / "checkpoint" / "00000001" / "params.msgpack")
    with pytest.raises(CheckpointError, match="params.msgpack is truncated"):
        load_params(tmp_path, {"w": np.zeros(64, np.float32)})


def test_keep_the_newest_k_checkpoints_and_a_torch_state_round_trips(tmp_path):
    for u in range(1, 5):
        _commit(tmp_path, u, codec=TORCH_CODEC, keep=2)
    ck = tmp_path / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["00000003", "00000004", "latest.json"]
    assert latest_meta(tmp_path)["checkpoint"] == "00000004"
    cp, _ = read_checkpoint(tmp_path)
    state = TORCH_CODEC.decode(cp.files, None)
    assert int(state["step"]) == 4 and np.array_equal(state["w"], STATE["w"] + 4)


# --- run directories -----------------------------------------------------------------------------------

TINY_PPO = ["--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16", "--layer-width", "64",
            "--total-timesteps", "512", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "4"]
COMMANDS = [
    ("ppo", TINY_PPO),
    ("ppo-hidden", TINY_PPO + ["--skip-n", "8"]),
    ("llm-policy", ["--model", "random:tiny", "--steps", "1"]),
]


@pytest.mark.parametrize("command,args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_train_command_refuses_an_existing_run_dir(tmp_path, capsys, command, args):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", command, *args, "--run-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and "--overwrite" in err
    assert [p.name for p in d.iterdir()] == ["metrics.jsonl"] and (d / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # the same flags and meaning everywhere: --resume names no path, and needs to know which run
    assert main(["train", command, *args, "--resume"]) == 2
    assert "--run-dir" in capsys.readouterr().err
    assert main(["train", command, *args, "--resume", "--overwrite", "--run-dir", str(d)]) == 2
    assert main(["train", command, *args, "--resume", "--run-dir", str(d)]) == 2  # no config.json: not a run
    assert "not a thinkcraft run directory" in capsys.readouterr().err


def test_overwrite_deletes_only_what_looks_like_a_run(tmp_path):
    from thinkcraft.train.checkpoint import prepare_run_dir
    from thinkcraft.utils.errors import UserError

    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    assert prepare_run_dir(run, overwrite=True) == run and not any(run.iterdir())
    (tmp_path / "src").mkdir()
    with pytest.raises(UserError, match="holds run, src, which no training run writes"):
        prepare_run_dir(tmp_path, overwrite=True)
    assert (tmp_path / "src").is_dir()


def _ppo_cfg(**kw):
    from thinkcraft.train.ppo import PPOConfig

    base = dict(env_name="craftax-classic", num_envs=8, num_steps=16, layer_width=64, total_timesteps=4096,
                updates_per_chunk=2, optimistic_reset_ratio=4)
    return PPOConfig(**{**base, **kw})


def _ppo_session(cfg):
    from thinkcraft.train.ppo import SHAPE_FIELDS, PPOConfig

    return TrainSession(cfg, "ppo", shape_fields=SHAPE_FIELDS, defaults=PPOConfig(),
                        total_steps=lambda c: c.num_updates * c.batch_size, title=lambda c: f"PPO {c.env_name}")


def test_resume_takes_title_totals_and_shapes_from_the_saved_config(tmp_path, capsys):
    d = tmp_path / "run"
    s = _ppo_session(_ppo_cfg(run_dir=str(d)))
    s.save_config()
    _commit(d, 2)
    # `train ppo --resume --run-dir d`: every other field at its default (Craftax-Symbolic, 1024 envs, 1e7 steps)
    from thinkcraft.train.ppo import PPOConfig

    r = _ppo_session(PPOConfig(run_dir=str(d), resume=True))
    assert r.resuming and r.checkpoint.update == 2
    assert r.cfg.env_name == "Craftax-Classic-Symbolic-v1" and r.cfg.num_envs == 8
    assert r.title == "PPO Craftax-Classic-Symbolic-v1" and r.total_steps == 4096
    assert f"resuming {d} from update 2 (256 steps)" in capsys.readouterr().err
    with pytest.raises(Exception, match="num_envs: saved 8, given 16"):
        _ppo_session(PPOConfig(run_dir=str(d), resume=True, num_envs=16))
    # checks across fields see the saved values (2 updates per chunk), not the defaults (8)
    assert _ppo_session(PPOConfig(run_dir=str(d), resume=True, stop_after_updates=2)).cfg.stop_after_updates == 2
    from thinkcraft.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of the chunk size \\(2 updates\\)"):
        _ppo_session(PPOConfig(run_dir=str(d), resume=True, stop_after_updates=3))
    # another command's run is named as such
    from thinkcraft.utils.errors import UserError

    s.save_config(command="llm-policy")
    with pytest.raises(UserError, match="train llm-policy --resume --run-dir"):
        _ppo_session(PPOConfig(run_dir=str(d), resume=True))


def test_nothing_in_the_run_dir_is_rewritten_before_the_checkpoint_verifies(tmp_path, capsys):
    d = tmp_path / "run"
    s = _ppo_session(_ppo_cfg(run_dir=str(d)))
    s.save_config()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": 128 * u}) + "\n" for u in (1, 2, 3)))
    _commit(d, 1)
    _commit(d, 2)
    _flip(d / "checkpoint" / "00000002" / "state.msgpack")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()}
    assert main(["train", "ppo", "--resume", "--run-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "00000002/state.msgpack is corrupt" in err and err.count("\n") == 1
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()} == before
    # --resume-fallback: the older checkpoint; the bad one set aside, metrics cut back, on restore
    from thinkcraft.train.ppo import PPOConfig

    r = _ppo_session(PPOConfig(run_dir=str(d), resume=True, resume_fallback=True))
    assert r.checkpoint.update == 1
    state = r.restore({"w": np.zeros(64, np.float32), "step": np.int32(0)})
    assert int(state["step"]) == 1
    assert [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()] == [128]
    assert latest_meta(d)["checkpoint"] == "00000001"
    assert any(p.name.startswith("corrupt-00000002") for p in (d / "checkpoint").iterdir())


def test_the_run_records_its_card_and_a_resume_elsewhere_adds_one(tmp_path, monkeypatch):
    """config.json's `_derived.hardware`: results collected on another machine (bench/ppo_parity.py,
    bench/llm_features.py) name the card the run computed on, not the collecting machine's."""
    import importlib
    import sys
    from pathlib import Path

    import thinkcraft.train.session as session_mod
    from thinkcraft.train.ppo import PPOConfig

    d = tmp_path / "run"
    s = _ppo_session(_ppo_cfg(run_dir=str(d)))
    s.save_config()
    assert json.loads((d / "config.json").read_text())["_derived"]["hardware"] == [session_mod.hardware_name()]
    _commit(d, 2)
    here = session_mod.hardware_name()
    monkeypatch.setattr(session_mod, "hardware_name", lambda: "Elsewhere GPU")
    r = _ppo_session(PPOConfig(run_dir=str(d), resume=True))
    r.save_config()
    hw = json.loads((d / "config.json").read_text())["_derived"]["hardware"]
    assert hw == [here, "Elsewhere GPU"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    common = importlib.import_module("common")
    assert common.run_card(d) == f"{here}+Elsewhere GPU"
    assert common.run_card(tmp_path / "no-such-run") == common.card()
