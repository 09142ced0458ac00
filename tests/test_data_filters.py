"""Trajectory filters (seed 003 §6) on constructed data; composition; filters inside pruned reads."""

from __future__ import annotations

import numpy as np
import pytest

from thinkcraft.data import (
    FilterReport,
    ReadReport,
    TrajectoryMetadata,
    TrajectoryRecord,
    TrajectoryWriter,
    Turn,
    apply_filters,
    balance_filter,
    completeness_filter,
    duplicate_filter,
    iter_batches,
    read_trajectories,
    records_to_table,
    reward_outlier_filter,
    zero_reward_group_filter,
)
from thinkcraft.data.filters import action_ngrams, robust_z


def rec(tid: str, reward: float = 0.0, task: str = "t", actions=("noop",), truncated=False, env_errors=0, seed=0):
    turns = [Turn(act=a, response_token_ids=[1, 2], logprobs=[-0.5, -0.5], loss_mask=[1, 1]) for a in actions]
    md = TrajectoryMetadata(truncated=truncated, env_errors=env_errors, seed=seed)
    return TrajectoryRecord.build(task, turns, md, trajectory_id=tid, total_reward=reward)


def ids(records):
    return [r.trajectory_id for r in records]


def test_completeness_filter_drops_and_counts():
    data = [rec("ok1"), rec("trunc", truncated=True), rec("err", env_errors=2), rec("both", truncated=True, env_errors=1), rec("ok2")]
    report = FilterReport()
    kept = apply_filters(data, [completeness_filter()], report)
    assert ids(kept) == ["ok1", "ok2"]
    s = report.stats["completeness"]
    assert (s.rows_in, s.rows_kept, s.reasons["truncated"], s.reasons["env_errors"]) == (5, 2, 2, 2)
    assert ids(apply_filters(data, [completeness_filter(drop_truncated=False)])) == ["ok1", "trunc", "ok2"]
    assert ids(apply_filters(data, [completeness_filter(drop_env_errors=False)])) == ["ok1", "err", "ok2"]
    # dropped rows can be kept for diagnostics
    diag = FilterReport(keep_dropped=True)
    apply_filters(records_to_table(data), [completeness_filter()], diag)
    assert diag.dropped["completeness"][0].column("trajectory_id").to_pylist() == ["trunc", "err", "both"]


def test_zero_reward_group_filter():
    data = [
        rec("a1", 0.0, task="A"), rec("a2", 0.0, task="A"),            # all zero: no GRPO signal
        rec("b1", 0.0, task="B"), rec("b2", 1.0, task="B"),            # mixed: keep
        rec("c1", 2.0, task="C"), rec("c2", 2.0, task="C"),            # constant but non-zero
        rec("d1", 0.0, task="D"),                                      # all zero, single
    ]
    report = FilterReport()
    assert ids(apply_filters(data, [zero_reward_group_filter()], report)) == ["b1", "b2", "c1", "c2"]
    assert report.stats["zero_reward_group"].reasons["groups_dropped"] == 2
    assert ids(apply_filters(data, [zero_reward_group_filter(drop_constant=True)])) == ["b1", "b2"]
    assert ids(apply_filters(data, [zero_reward_group_filter(keep_fraction=1.0)])) == ids(data)
    # keeping a share of all-zero groups as negatives: whole groups, the same ones on every call
    many = [rec(f"g{g}-{k}", 0.0, task=f"G{g}") for g in range(200) for k in range(2)]
    kept1 = ids(apply_filters(many, [zero_reward_group_filter(keep_fraction=0.25)]))
    kept2 = ids(apply_filters(many, [zero_reward_group_filter(keep_fraction=0.25)]))
    assert kept1 == kept2 and 0.1 < len(kept1) / len(many) < 0.4 and len(kept1) % 2 == 0
    # groups by another column
    by_seed = [rec("s1", 0.0, task="x", seed=1), rec("s2", 0.0, task="y", seed=1), rec("s3", 1.0, task="x", seed=2)]
    assert ids(apply_filters(by_seed, [zero_reward_group_filter(group_by="metadata.seed")])) == ["s3"]


def test_reward_outlier_filter():
    rng = np.random.default_rng(0)
    rewards = list(rng.normal(1.0, 0.1, 50)) + [25.0, -30.0]
    data = [rec(f"r{i}", r) for i, r in enumerate(rewards)]
    report = FilterReport()
    kept = ids(apply_filters(data, [reward_outlier_filter(z_max=5.0)], report))
    assert "r50" not in kept and "r51" not in kept and len(kept) == 50
    assert report.stats["reward_outlier"].reasons["z_outliers"] == 2
    # mostly-zero sparse rewards: MAD is 0, the std fallback must not call every success an outlier
    sparse = [rec(f"s{i}", 1.0 if i < 10 else 0.0) for i in range(100)]
    assert len(apply_filters(sparse, [reward_outlier_filter()])) == 100
    assert ids(apply_filters(data[:3] + [rec("nan", float("nan"))], [reward_outlier_filter()])) == ["r0", "r1", "r2"]
    bounded = apply_filters([rec("lo", -1.0), rec("mid", 0.5), rec("hi", 9.0)], [reward_outlier_filter(low=0.0, high=5.0)])
    assert ids(bounded) == ["mid"]
    z = robust_z(np.array([1.0, 1.0, 1.0]))
    assert np.all(z == 0)


def test_duplicate_filter_action_ngrams():
    loop = ("up", "do", "up", "do", "up", "do", "up", "do")
    data = [
        rec("first", actions=loop),
        rec("copy", actions=loop),                                              # identical: drop
        rec("near", actions=loop[:-1] + ("noop",)),                              # 4 of 5 4-grams shared... still dup
        rec("other", actions=("left", "left", "right", "place", "do", "sleep", "noop", "up")),
        rec("short", actions=("do",)),
    ]
    f = duplicate_filter(n=4, max_similarity=0.5)
    report = FilterReport()
    assert ids(apply_filters(data, [f], report)) == ["first", "other", "short"]
    assert report.stats["duplicate"].reasons["near_duplicates"] == 2
    # state carries across calls: what was kept before is compared against
    assert ids(apply_filters([rec("again", actions=loop), rec("fresh", actions=("a", "b", "c", "d", "e"))], [f])) == ["fresh"]
    f.reset()
    assert ids(apply_filters([rec("again", actions=loop)], [f])) == ["again"]
    assert action_ngrams(["a", "b", "c"], 2) == {"a\x1fb", "b\x1fc"} and action_ngrams(["a"], 3) == {"a"}
    # chunking gives the same answer as one pass
    many = [rec(f"m{i}", actions=tuple(f"a{(i * 7 + k) % 13}" for k in range(6))) for i in range(60)]
    one = duplicate_filter(n=2, max_similarity=0.3)
    chunked = duplicate_filter(n=2, max_similarity=0.3)
    chunked.chunk_rows = 7
    assert ids(apply_filters(many, [one])) == ids(apply_filters(many, [chunked]))


def test_balance_filter():
    data = [rec(f"p{i}", 1.0) for i in range(10)] + [rec("n0", 0.0), rec("n1", -1.0)]
    report = FilterReport()
    kept = apply_filters(data, [balance_filter(max_ratio=2.0, seed=3)], report)
    pos = [r for r in kept if r.total_reward > 0]
    assert len(pos) == 4 and {"n0", "n1"} <= set(ids(kept))
    assert report.stats["balance"].reasons["positives_dropped"] == 6
    # negatives in the majority are capped the same way
    neg_heavy = [rec(f"n{i}", 0.0) for i in range(9)] + [rec("p", 1.0)]
    assert len(apply_filters(neg_heavy, [balance_filter(max_ratio=3.0)])) == 4
    # a one-sided batch cannot be balanced: kept, counted
    rep = FilterReport()
    assert len(apply_filters([rec("x", 1.0), rec("y", 2.0)], [balance_filter()], rep)) == 2
    assert rep.stats["balance"].reasons["one_sided_batches"] == 1
    with pytest.raises(ValueError):
        balance_filter(max_ratio=0.5)


def test_filters_compose_in_order_and_run_in_pruned_reads(tmp_path):
    data = (
        [rec(f"good{i}", 1.0, task=f"T{i}", actions=(f"x{i}", f"y{i}", "do", "do")) for i in range(4)]
        + [rec("trunc", 1.0, task="T0", truncated=True), rec("z1", 0.0, task="Z"), rec("z2", 0.0, task="Z")]
        + [rec("dup", 1.0, task="T1", actions=("x0", "y0", "do", "do"))]
        + [rec("neg", 0.0, task="T2", actions=("q", "r", "s", "t"))]
    )
    with TrajectoryWriter(tmp_path, run="f", max_per_file=3) as w:
        for r in data:
            w.add(r)
    filters = [completeness_filter(), zero_reward_group_filter(), duplicate_filter(n=2, max_similarity=0.8),
               balance_filter(max_ratio=2.0)]
    report = ReadReport()
    table = read_trajectories(tmp_path, columns=["trajectory_id", "total_reward"], filters=filters, as_table=True,
                              report=report)
    assert table.column_names == ["trajectory_id", "total_reward"]  # filter-only columns are not returned
    kept = table.column("trajectory_id").to_pylist()
    assert "trunc" not in kept and "z1" not in kept and "dup" not in kept and "neg" in kept
    assert sum(1 for k in kept if k.startswith("good")) == 2  # 4 positives capped at 2 x 1 negative
    summary = report.filters.summary()
    assert summary["completeness"]["dropped"] == 1 and summary["zero_reward_group"]["dropped"] == 2
    assert summary["duplicate"]["dropped"] == 1 and summary["balance"]["dropped"] == 2
    # per batch in a stream; the duplicate filter remembers across batches
    dup = duplicate_filter(n=2, max_similarity=0.8)
    streamed = [r.trajectory_id for b in iter_batches(tmp_path, batch_size=2, columns=["trajectory_id"], filters=[dup]) for r in b]
    # "dup" repeats good0's actions (an earlier batch); z1, z2 repeat trunc's single "noop"
    assert streamed == ["good0", "good1", "good2", "good3", "trunc", "neg"]
