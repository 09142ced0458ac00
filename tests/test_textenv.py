"""Text envs and tasks: arith/gsm8k problems, rule and judge rewards, the reset/step protocol."""

import json

import numpy as np
import pytest

from thinkcraft.envs.textenvs import (
    ArithTask, GSM8KTask, JudgeReward, Problem, RuleReward, TaskEnv, TextEnv, extract_hash_answer, load_gsm8k,
    make_text_env, numbers_equal, parse_verdict,
)
from thinkcraft.llm.protocol import Capabilities, Completion
from thinkcraft.utils.errors import ConfigError, UserError


def test_extract_hash_answer_and_number_equality():
    assert extract_hash_answer("so 3+4=7\n#### 7") == "7"
    assert extract_hash_answer("#### 1,000") == "1000"
    assert extract_hash_answer("#### $-3.50 dollars") == "-3.50"
    assert extract_hash_answer("#### 2 ... wait #### 5") == "5"  # the last one counts
    assert extract_hash_answer("the answer is 7") is None
    assert numbers_equal("-3.50", "-3.5") and numbers_equal("7.0", "7") and not numbers_equal("7", "8")
    assert not numbers_equal(None, "7") and not numbers_equal("x", "x")


@pytest.mark.parametrize("difficulty", [1, 2, 3, 5])
def test_arith_is_deterministic_and_correct(difficulty):
    t = ArithTask(difficulty)
    for seed in range(30):
        p = t.problem(seed)
        assert p == t.problem(seed)
        assert int(p.answer) >= 0 and p.question.endswith("now?")
    assert len({t.problem(s).question for s in range(30)}) > 20


def test_arith_level1_answer_is_the_sum_or_difference():
    import re

    for seed in range(20):
        p = ArithTask(1).problem(seed)
        nums = [int(x) for x in re.findall(r"\d+", p.question)]
        assert int(p.answer) in (nums[0] + nums[1], nums[0] - nums[1])


def test_arith_bad_difficulty():
    with pytest.raises(ConfigError, match="difficulty"):
        ArithTask(0)


def test_rule_reward_format_and_answer():
    r = RuleReward(answer_weight=1.0, format_weight=0.1)
    p = Problem("q", "7")
    out = r([p, p, p], ["#### 7", "#### 8", "seven"])
    assert [o.reward for o in out] == pytest.approx([1.1, 0.1, 0.0])
    assert [o.correct for o in out] == [True, False, False]
    assert [o.format_ok for o in out] == [True, True, False]


def _gsm8k_rows():
    return [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
    ]


def test_gsm8k_jsonl_and_parquet(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows()))
    probs = load_gsm8k(p)
    assert [x.answer for x in probs] == ["7", "1234"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_gsm8k_rows()), tmp_path / "g.parquet")
    assert [x.answer for x in load_gsm8k(tmp_path / "g.parquet")] == ["7", "1234"]
    t = GSM8KTask(p)
    assert t.problem(3) == probs[1]


def test_gsm8k_missing_field_names_the_row(tmp_path):
    rows = _gsm8k_rows() + [{"question": "no answer here"}]
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"row 3: missing field\(s\) answer"):
        load_gsm8k(p)
    p.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(UserError, match="row 1: answer has no final"):
        load_gsm8k(p)
    with pytest.raises(UserError, match="not found"):
        load_gsm8k(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "reply,expected",
    [
        ("CORRECT", True),
        ("INCORRECT", False),
        ("The student's answer is not correct.", False),
        ("Incorrect. Wait, re-checking: 3+4=7, so it is correct", True),
        ('{"correct": false}', False),
        ('```json\n{"verdict": "CORRECT"}\n```', True),
        ("<think>is it correct? no idea</think>\nVerdict: INCORRECT", False),
        ("Verdict: **correct**", True),
        ("1", True),
        ("0", False),
        ("yes", True),
        ("", None),
        ("asdf qwerty 42", None),
        ("<think>correct</think>", None),
    ],
)
def test_parse_verdict(reply, expected):
    assert parse_verdict(reply) is expected


class _FakeJudge:
    """An engine that answers the judge prompts from a fixed list of replies."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.prompts = []

    @property
    def capabilities(self):
        return Capabilities(hidden_states=False, generate=True, logprobs=False, prefix_reuse=False)

    def generate(self, batch, sampling):
        self.prompts.extend(batch.items)
        return [Completion(token_ids=[], text=self.replies.pop(0), logprobs=None, finish_reason="stop") for _ in batch.items]

    def hidden_states(self, batch, layer=-1, pooling="last"):
        raise NotImplementedError

    def close(self):
        pass


def test_judge_reward_garbage_is_zero_and_counted():
    eng = _FakeJudge(["CORRECT", "%%%garbage%%%", "INCORRECT"])
    j = JudgeReward(eng, format_weight=0.5)
    p = Problem("What is 3+4?", "7")
    out = j([p, p, p], ["#### 7", "#### 7", "I think 8"])
    assert [o.reward for o in out] == pytest.approx([1.5, 0.5, 0.0])
    assert j.counters()["judge/unparsed"] == 1 and j.counters()["judge/calls"] == 3
    assert "Reference answer: 7" in eng.prompts[0] and "Student's answer: 7" in eng.prompts[0]
    assert "I think 8" in eng.prompts[2]  # no #### line: the completion's tail goes to the judge


def test_task_env_protocol_groups_and_termination():
    env = make_text_env("arith", reward_fn=RuleReward(format_weight=0.1), difficulty=1)
    assert isinstance(env, TextEnv)
    obs = env.reset([5, 5, 9])
    assert obs[0] == obs[1] != obs[2]  # a repeated seed is a GRPO group: the same problem
    assert env.active_indices() == [0, 1, 2]
    gold = env.problems[0].answer
    res = env.step([f"#### {gold}", "no idea", f"#### {int(env.problems[2].answer) + 1}"])
    assert res.rewards.tolist() == pytest.approx([1.1, 0.0, 0.1])
    assert res.terminated.all() and not res.truncated.any()
    assert [i["invalid"] for i in res.infos] == [False, True, False]
    assert env.active_indices() == []
    assert env.counters()["format/invalid"] == 1
    with pytest.raises(ValueError):
        env.step(["x"])


def test_make_text_env_errors():
    with pytest.raises(UserError, match="gsm8k-path"):
        make_text_env("gsm8k")
    with pytest.raises(UserError, match="unknown text env"):
        make_text_env("chess")


def test_rule_reward_lenient_takes_the_last_number():
    p = Problem("q", "7")
    strict, lenient = RuleReward(format_weight=0.1), RuleReward(format_weight=0.1, lenient=True)
    texts = ["14 - 7 = 7.", "#### 8 but really 7", "no numbers"]
    assert [o.reward for o in strict([p] * 3, texts)] == pytest.approx([0.0, 0.1, 0.0])
    out = lenient([p] * 3, texts)
    assert [o.reward for o in out] == pytest.approx([1.0, 0.1, 0.0])  # a #### line wins over later numbers
    assert [o.format_ok for o in out] == [False, True, False]
