"""llm-policy: config validation, masks, learner updates, multi-turn rollout, resume, store, CLI end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from thinkcraft.envs.textenvs import ArithTask, RewardResult, StepResult, TaskEnv
from thinkcraft.llm.protocol import Capabilities, SamplingParams
from thinkcraft.train import llm_policy as LP
from thinkcraft.utils.errors import ConfigError, UserError


def _cfg(tmp_path, **kw):
    base = dict(model="random:tiny", run_dir=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=3,
                max_new_tokens=8, micro_batch_size=4, lr=1e-2, plot=False, log_every_s=1e9)
    base.update(kw)
    return LP.LLMPolicyConfig(**base)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(group_size=1), "group-size"),
        (dict(algo="apo", env="craftax"), "algo"),
        (dict(env="gsm8k"), "gsm8k-path"),
        (dict(temperature=0.0), "temperature"),
        (dict(reward="judge", env="craftax-classic"), "reward"),
        (dict(thinking_budget=500, max_new_tokens=100), "thinking-budget"),
    ],
)
def test_config_rejects_bad_combinations(tmp_path, kw, field):
    with pytest.raises(ConfigError, match=field):
        _cfg(tmp_path, **kw)


def test_engine_without_logprobs_is_an_error():
    caps = Capabilities(hidden_states=False, generate=True, logprobs=False, prefix_reuse=False)
    for algo in ("grpo", "rloo", "reinforce"):
        with pytest.raises(UserError, match="logprobs"):
            LP.check_engine_for_algo(caps, algo)
    LP.check_engine_for_algo(caps, "apo")  # A*-PO needs only the learner's own logprobs


def _turn(prompt, completion, logprobs=None, train_mask=None, reward=0.0):
    return LP.TurnRecord(obs="o", prompt_ids=list(prompt), completion_ids=list(completion),
                         logprobs=list(logprobs or [-1.0] * len(completion)),
                         train_mask=list(train_mask or [1] * len(completion)), text="", finish_reason="stop",
                         reward=reward)


def test_build_rows_masks_only_generated_unforced_tokens():
    turns = [_turn([1, 2, 3], [7, 8], [-0.5, -0.25]), _turn([4, 5], [9, 9, 9], train_mask=[1, 0, 1])]
    rows = LP.build_rows(turns, [1.0, -1.0], [1.0, 0.0], pad_id=0, device=torch.device("cpu"))
    assert rows.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 5, 9, 9, 9]]
    # predicted position t predicts token t+1: row 0 completion tokens at 3,4 -> positions 2,3
    assert rows.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 1]]
    assert rows.old_logp[0].tolist() == [0, 0, -0.5, -0.25]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_multi_turn_returns_and_groups():
    e0 = LP.Trajectory(seed=5, group=0, turns=[_turn([1], [2], reward=1.0), _turn([1], [2], reward=2.0)])
    e1 = LP.Trajectory(seed=5, group=0, turns=[_turn([1], [2], reward=0.0)])
    e2 = LP.Trajectory(seed=6, group=1, turns=[_turn([1], [2], reward=3.0)])
    scores, groups = LP.row_scores_and_groups([e0, e1, e2], gamma=0.5, max_turns=4)
    assert scores == pytest.approx([2.0, 2.0, 0.0, 3.0])
    # turn 0 of both samples of seed 5 share a group; turn 1 is its own; seed 6 is another group
    assert groups[0] == groups[2] and len({groups[0], groups[1], groups[3]}) == 3


@pytest.fixture(scope="module")
def tiny():
    cfg = LP.LLMPolicyConfig(model="random:tiny", finetune="lora", lr=1e-2, micro_batch_size=2, max_grad_norm=0.0)
    texts = [ArithTask(1).problem(s).question for s in range(200)]
    model, tok = LP.load_policy(cfg, texts, torch.device("cpu"), torch.float32)
    return cfg, model, tok


def test_learner_accumulation_equals_full_batch_and_moves_only_lora(tiny):
    cfg, model, tok = tiny
    turns = [_turn([5, 6, 7], [8, 9, 10]), _turn([5, 6], [11]), _turn([12, 13, 14, 15], [16, 17]), _turn([5], [6, 7])]
    grads = {}
    for mb in (1, 4):
        learner = LP.Learner(LP.LLMPolicyConfig(**{**cfg.__dict__, "micro_batch_size": mb}), model, tok,
                             torch.device("cpu"), None)
        rows = LP.build_rows(turns, [1.0, -2.0, 0.5, 1.5], [0, 0, 0, 0], tok.pad_token_id, torch.device("cpu"))
        with torch.no_grad():  # on-policy old logprobs so that the ratio is 1
            rows.old_logp.copy_(learner.token_logprobs(rows.input_ids, rows.attention_mask) * rows.loss_mask)
        learner.optimizer.step = lambda: None  # keep weights: compare gradients only
        learner.update(rows)
        grads[mb] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for n in grads[1]:
        assert torch.allclose(grads[1][n], grads[4][n], atol=1e-6), n
    assert any(g.abs().sum() > 0 for g in grads[1].values())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = LP.Learner(cfg, model, tok, torch.device("cpu"), None)
    learner.update(rows)
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)


class CountdownEnv:
    """A 3-turn text env: reward 1 for a reply containing a digit."""

    name = "countdown"
    system_prompt = "Reply with a number."
    max_turns = 3

    def reset(self, seeds):
        self.t = [0] * len(seeds)
        self.done = [False] * len(seeds)
        return [f"turn 0 of seed {s}" for s in seeds]

    def active_indices(self):
        return [i for i, d in enumerate(self.done) if not d]

    def step(self, actions, indices=None):
        active = self.active_indices() if indices is None else list(indices)
        obs, rew, term = [], [], []
        for i, a in zip(active, actions):
            self.t[i] += 1
            end = self.t[i] >= 3
            self.done[i] = end
            obs.append("" if end else f"turn {self.t[i]}")
            rew.append(float(any(ch.isdigit() for ch in a)))
            term.append(end)
        n = len(active)
        return StepResult(obs, np.array(rew, np.float32), np.array(term), np.zeros(n, bool), [{} for _ in range(n)])

    def counters(self):
        return {}


def test_learner_refuses_parameters_off_its_device(tiny):
    """A learner whose model was moved under it (seen once with an engine copy on a second GPU) stops at the
    update with the tensors named, not deep inside the embedding."""
    cfg, model, tok = tiny
    learner = LP.Learner(cfg, model, tok, torch.device("cpu"), None)
    rows = LP.build_rows([_turn([5, 6], [7, 8])], [1.0], [0], tok.pad_token_id, torch.device("cpu"))
    learner.device = torch.device("cuda", 1)  # the learner's device; every parameter is elsewhere (the CPU)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"must be on cuda:1.*embed_tokens"):
        learner.update(rows)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing trained


def test_an_unindexed_cuda_device_is_pinned_to_the_current_gpu(monkeypatch):
    """`--device cuda` names one GPU for the whole run: the current one when the run starts (threads that make
    another GPU current later must not move the learner's tensors); `auto` is cuda:0 by name, whatever is current
    (2 x H200, 2026-11-29: JAX's start had left cuda:1 current, and a learner meant for cuda:0 shared cuda:1)."""
    from thinkcraft.train.llm_policy import model as M

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert M._device("auto") == torch.device("cuda", 0) and M._device("cuda") == torch.device("cuda", 1)
    assert M._device("cuda:0") == torch.device("cuda", 0) and M._device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"rollout-devices: 'cuda:2': this machine has 2 GPU\(s\)"):
        M._device("cuda:2", flag="rollout_devices")  # a GPU it lacks: said before anything loads


def test_rollout_multi_turn_keeps_engine_tokens_and_history_window(tiny):
    cfg, model, tok = tiny
    engine = LP.make_engine(model, tok, cfg)
    eps = LP.rollout(CountdownEnv(), engine, tok, seeds=[3, 4], samples_per_seed=2,
                     sampling=SamplingParams(max_new_tokens=4), history_turns=1)
    assert [e.group for e in eps] == [0, 0, 1, 1] and [e.seed for e in eps] == [3, 3, 4, 4]
    for e in eps:
        assert len(e.turns) == 3 and e.terminated
        for t in e.turns:
            assert 1 <= len(t.completion_ids) <= 4 and len(t.logprobs) == len(t.completion_ids)
            assert all(lp <= 0 for lp in t.logprobs)
        last_prompt = tok.decode(e.turns[2].prompt_ids)
        assert "turn 1" in last_prompt and "turn 0 of seed" not in last_prompt  # K = 1 past turn


class _ParityReward:
    """Completion length parity: a reward with variance for a random-weight model."""

    def __call__(self, problems, completions):
        return [RewardResult(reward=float(len(c) % 2), correct=bool(len(c) % 2), format_ok=True) for c in completions]

    def counters(self):
        return {}


class _FirstLetterReward(_ParityReward):
    """1 when the completion starts with a letter a-m (about a third of a random model's samples): learnable
    from the first token alone, whose context (the chat template's assistant header) every prompt shares."""

    def __call__(self, problems, completions):
        hit = [c.lstrip()[:1].lower() in set("abcdefghijklm") for c in completions]
        return [RewardResult(reward=float(h), correct=h, format_ok=True) for h in hit]


def _patch_reward(monkeypatch, reward=None):
    import thinkcraft.train.llm_policy.loop as loop  # where run() looks it up

    reward = reward or _ParityReward()
    monkeypatch.setattr(loop, "make_env_and_reward", lambda cfg, judge=None: TaskEnv(ArithTask(1), reward))


def _lora(run_dir):
    from thinkcraft.train.checkpoint import TORCH_CODEC, read_checkpoint

    cp, _ = read_checkpoint(run_dir)
    st = TORCH_CODEC.decode(cp.files, None)
    return st["step"], st["trainable"]


@pytest.mark.slow
def test_run_resume_matches_uninterrupted_and_writes_store(tmp_path, monkeypatch, capsys):
    from thinkcraft.train.checkpoint import CheckpointError

    _patch_reward(monkeypatch)
    figures = []
    import thinkcraft.utils.plot as plot

    real_save = plot.save_figure
    monkeypatch.setattr(plot, "save_figure", lambda fig, out: figures.append(fig.axes[-1].get_xlabel()) or real_save(fig, out))
    straight = _cfg(tmp_path / "a", steps=2, checkpoint_every=0, plot=True)
    LP.run(straight)
    assert figures == ["learner steps"]  # the x axis says what it plots
    assert "done: 2/2 steps; reward" in capsys.readouterr().err  # a final summary line, as ppo's
    b = tmp_path / "b" / "run"
    LP.run(_cfg(tmp_path / "b", steps=2, checkpoint_every=1))  # checkpoints at steps 1 and 2
    with pytest.raises(UserError, match="--resume"):  # an existing run dir is never reused silently
        LP.run(_cfg(tmp_path / "b", steps=2))
    # step 2's checkpoint is damaged: named; --resume-fallback replays step 2 from step 1's, exactly
    state = b / "checkpoint" / "00000002" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="00000002/state.pt is corrupt"):
        LP.run(_cfg(tmp_path / "b", resume=True))
    capsys.readouterr()
    LP.run(_cfg(tmp_path / "b", resume=True, resume_fallback=True))
    assert f"resuming {b} from step 1" in capsys.readouterr().err
    step_a, wa = _lora(straight.run_dir)
    step_b, wb = _lora(b)
    assert step_a == step_b == 2
    assert any(v.abs().sum() > 0 for n, v in wa.items() if "lora_B" in n)  # LoRA moved (B starts at 0)
    for n in wa:
        assert torch.allclose(wa[n], wb[n], atol=1e-6), n
    recs = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for k in ("reward/mean", "format/invalid_rate", "timing/generate", "timing/train", "perf/samples_per_s",
              "perf/tokens_per_s"):
        assert k in recs[-1]
    from thinkcraft.data.reader import read_table
    from thinkcraft.data.schema import table_to_records

    # step 2's episodes were played twice; the store holds them once
    records = table_to_records(read_table(b / "trajectories"))
    assert len(records) == 2 * 2 * 3
    assert sorted(r.metadata.policy_version for r in records) == [0] * 6 + [1] * 6
    from thinkcraft.data.summary import summarize_store

    summary, _ = summarize_store(b / "trajectories")  # `data inspect` numbers steps as metrics do
    assert (summary.learner_steps.min, summary.learner_steps.max) == (1, 2) and summary.policy_lag.max == 1
    t = records[0].turns[0]
    assert len(t.response_token_ids) == len(t.logprobs) == len(t.loss_mask) > 0 and len(t.prompt_token_ids) > 0


@pytest.mark.slow
def test_sigterm_checkpoints_after_the_step_in_flight_and_exits_0(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    d = tmp_path / "run"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--model", "random:tiny", "--steps", "500", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--checkpoint-every", "0", "--no-plot", "--no-store"]
    p = subprocess.Popen([sys.executable, "-m", "thinkcraft", "train", "llm-policy", *args, "--run-dir", str(d)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = d / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and metrics.read_text().strip()):
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    step, _ = _lora(d)
    assert 1 <= step < 500
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, step + 1))
    assert f"SIGTERM: stopped at step {step} with a checkpoint" in err
    assert f"continue with: thinkcraft train llm-policy --resume --run-dir {d}" in err
    from thinkcraft.cli import main

    assert main(["train", "llm-policy", "--resume", "--run-dir", str(d), "--steps", str(step + 1)]) == 0
    assert _lora(d)[0] == step + 1
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, step + 2))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rloo", "reinforce", "apo"])
def test_other_algorithms_run_and_learn(tmp_path, monkeypatch, algo):
    # 10 steps of full fine-tuning, 64 samples a step, on a reward the first token decides: the mean reward
    # of the last 3 steps beats the first 3 by 0.27-0.51 (RLOO, REINFORCE; seeds 0-1) and 0.15-0.28 (A*-PO,
    # which samples once per prompt and regresses on a soft-max V*; seeds 0-2)
    _patch_reward(monkeypatch, _FirstLetterReward())
    cfg = _cfg(tmp_path, algo=algo, steps=10, prompts_per_step=64 if algo == "apo" else 8, group_size=8,
               max_new_tokens=2, micro_batch_size=64, finetune="full", lr=1e-2, checkpoint_every=0,
               apo_pool_size=64, apo_ref_samples=4, apo_beta2=0.1)
    last = LP.run(cfg)
    assert last["policy_version"] == 10 and np.isfinite(last["losses/loss"])
    rewards = [json.loads(x)["reward/mean"] for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(rewards[-3:]) >= np.mean(rewards[:3]) + 0.1, rewards


@pytest.mark.slow
def test_cli_train_llm_policy_arith_bundled_model(tmp_path):
    from thinkcraft.cli import main
    from thinkcraft.llm.models import resolve_model

    try:
        resolve_model("default")
    except UserError as e:
        pytest.skip(f"bundled model not available: {e}")
    from thinkcraft.data.reader import read_table

    # A 1-step run whose 8 samples all score the same has no advantage, hence no gradient to check: the seed's
    # samples are not bit-stable across CPUs (CI once drew such a group with seed 1), so up to three seeds are tried
    for seed in (1, 2, 3):
        run_dir = tmp_path / f"cli-{seed}"
        rc = main(["train", "llm-policy", "--env", "arith", "--algo", "grpo", "--model", "default", "--run-dir",
                   str(run_dir), "--steps", "1", "--prompts-per-step", "1", "--group-size", "8", "--max-new-tokens",
                   "12", "--lenient-answer", "--lr", "1e-3", "--seed", str(seed), "--micro-batch-size", "8",
                   "--no-plot"])
        assert rc == 0
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert recs[-1]["step"] == 1
        assert read_table(run_dir / "trajectories").num_rows == 8
        if recs[-1]["reward/std"] > 0:
            break
    else:
        pytest.skip("every sample scored the same in three 1-step runs (seeds 1-3): no gradient to check")
    _, w = _lora(run_dir)
    assert any(v.abs().sum() > 0 for n, v in w.items() if "lora_B" in n)


@pytest.mark.slow
def test_judge_reward_with_garbage_verdicts_never_crashes(tmp_path):
    # the judge is the random-weight policy itself (adapter off): its verdicts are garbage -> 0 and counted
    cfg = _cfg(tmp_path, steps=1, prompts_per_step=1, group_size=2, reward="judge", judge_engine="self",
               format_weight=0.0, store=False)
    last = LP.run(cfg)
    assert last["judge/calls"] == 2 and last["judge/unparsed"] >= 1 and last["judge/unparsed_rate"] > 0
    assert last["reward/mean"] <= 0.5  # an unparsable verdict scores 0


def test_split_think():
    assert LP._split_think("<think>hmm 3+4</think>\n#### 7") == ("hmm 3+4", "#### 7")
    assert LP._split_think("#### 7") == ("", "#### 7")
