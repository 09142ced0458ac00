"""analysis.stats: IQM equals scipy's trim_mean (rliable's definition), the bootstrap intervals cover the truth
about as often as they claim, results repeat under a seed, and the curve/final helpers."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import trim_mean

from thinkcraft.analysis.stats import (
    bootstrap_ci, bootstrap_mean_band, common_grid, final_value, interpolate_to_grid, iqm,
    probability_of_improvement, probability_of_improvement_ci, stat_mean, trailing_mean,
)


def test_iqm_known_values():
    assert iqm(np.array([1.0, 2, 3, 4])) == 2.5  # drops 1 and 4
    assert iqm(np.array([1.0, 2, 3, 4, 100])) == 3.0  # n = 5: floor(5/4) = 1 cut each side -> mean(2, 3, 4)
    assert iqm(np.array([5.0, 1, 3])) == 3.0  # n < 4: nothing cut
    assert iqm(np.array([7.0])) == 7.0
    assert iqm(np.array([8.0, 1, 2, 3, 4, 5, 6, 7])) == 4.5  # n = 8: 2 cut each side -> mean(3, 4, 5, 6)


@pytest.mark.parametrize("n", range(1, 14))
def test_iqm_equals_scipy_trim_mean(n):
    rng = np.random.default_rng(n)
    x = rng.standard_cauchy(size=(3, n))
    np.testing.assert_allclose(iqm(x, axis=-1), trim_mean(x, 0.25, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(iqm(x.T, axis=0), trim_mean(x.T, 0.25, axis=0), rtol=1e-12)


def test_bootstrap_ci_is_seeded():
    x = np.random.default_rng(0).normal(size=7)
    a, b = bootstrap_ci(x, reps=500, seed=3), bootstrap_ci(x, reps=500, seed=3)
    assert a == b
    assert bootstrap_ci(x, reps=500, seed=4) != a
    assert a.low <= a.point <= a.high
    assert a.point == pytest.approx(trim_mean(x, 0.25))


def test_bootstrap_ci_single_run_is_degenerate():
    ci = bootstrap_ci(np.array([3.0]), reps=100)
    assert ci == (3.0, 3.0, 3.0)


def test_bootstrap_ci_coverage_on_synthetic_data():
    """95% percentile intervals of the mean of 20 normal draws contain the true mean ~95% of the time
    (the percentile bootstrap undercovers a little at small n: expect 0.88-0.99 over 300 experiments)."""
    rng = np.random.default_rng(1)
    hits = 0
    trials = 300
    for t in range(trials):
        x = rng.normal(loc=2.0, scale=1.5, size=20)
        ci = bootstrap_ci(x, statistic=stat_mean, reps=400, seed=t)
        hits += ci.low <= 2.0 <= ci.high
    assert 0.88 <= hits / trials <= 0.99, hits / trials


def test_bootstrap_ci_narrows_with_more_seeds():
    rng = np.random.default_rng(2)
    small = bootstrap_ci(rng.normal(size=5), reps=1000)
    large = bootstrap_ci(rng.normal(size=200), reps=1000)
    assert large.high - large.low < small.high - small.low


def test_stratified_bootstrap_resamples_within_tasks():
    # two tasks on very different scales: a resample mixing runs across tasks would leave the range below
    x = np.stack([np.arange(5.0), 1000 + np.arange(5.0)], axis=1)  # (runs, tasks)
    ci = bootstrap_ci(x, statistic=stat_mean, reps=2000, seed=0)
    assert ci.point == pytest.approx(502.0)
    assert 500.0 <= ci.low <= ci.high <= 504.0


def test_probability_of_improvement():
    assert probability_of_improvement(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert probability_of_improvement(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 0.0
    assert probability_of_improvement(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == 0.5
    # 1 beats {0}, ties {1}, loses to {2}; 3 beats all three: (1 + 0.5 + 0 + 3) / 6
    assert probability_of_improvement(np.array([1.0, 3.0]), np.array([0.0, 1.0, 2.0])) == pytest.approx(4.5 / 6)
    x, y = np.random.default_rng(0).normal(size=(2, 6))
    assert probability_of_improvement(x, y) + probability_of_improvement(y, x) == pytest.approx(1.0)
    ci = probability_of_improvement_ci(x, y, reps=300, seed=1)
    assert ci == probability_of_improvement_ci(x, y, reps=300, seed=1)
    assert 0.0 <= ci.low <= ci.point <= ci.high <= 1.0


def test_mean_band():
    curves = np.array([[0.0, 1.0, 2.0], [2.0, 3.0, 4.0], [1.0, 2.0, 3.0]])
    mean, low, high = bootstrap_mean_band(curves, reps=500, seed=0)
    np.testing.assert_allclose(mean, [1.0, 2.0, 3.0])
    assert np.all(low <= mean) and np.all(mean <= high)
    # every seed's curve is the others shifted: a resample shifts all points alike, so the band is too
    np.testing.assert_allclose(high - low, (high - low)[0])
    a = bootstrap_mean_band(curves, reps=500, seed=0)
    np.testing.assert_array_equal(a[1], low)
    one = bootstrap_mean_band(curves[:1], reps=50)
    np.testing.assert_allclose(one[1], curves[0])
    np.testing.assert_allclose(one[2], curves[0])


def test_interpolate_to_grid_no_extrapolation():
    out = interpolate_to_grid(np.array([10, 20, 30]), np.array([1.0, 3.0, 2.0]), np.array([5, 10, 15, 30, 35.0]))
    np.testing.assert_allclose(out[1:4], [1.0, 2.0, 2.0])
    assert np.isnan(out[0]) and np.isnan(out[4])
    # unsorted input and a repeated step (the later value wins)
    out = interpolate_to_grid(np.array([20, 10, 20]), np.array([5.0, 1.0, 3.0]), np.array([15.0]))
    np.testing.assert_allclose(out, [2.0])


def test_common_grid():
    g = common_grid([np.array([0, 50, 100]), np.array([10, 80])], 8)
    assert g[0] == 10 and g[-1] == 80 and len(g) == 8
    assert len(common_grid([np.array([0, 5]), np.array([6, 9])], 8)) == 0
    np.testing.assert_array_equal(common_grid([np.array([4]), np.array([4])], 8), [4.0])


def test_final_value():
    steps = np.arange(1, 101) * 10
    vals = np.arange(1, 101, dtype=float)
    assert final_value(steps, vals, 0.1) == pytest.approx(np.mean(np.arange(91, 101)))  # steps 910..1000
    assert final_value(steps, vals, 0.0) == 100.0
    assert final_value(np.array([500, 1000]), np.array([1.0, 2.0]), 0.1) == 2.0  # sparse logging: last record


def test_trailing_mean():
    steps = np.array([1.0, 2, 3, 4, 6])
    vals = np.array([1.0, 2, 3, 4, 5])
    np.testing.assert_allclose(trailing_mean(steps, vals, 2.0), [1.0, 1.5, 2.5, 3.5, 5.0])  # (s - 2, s]
    np.testing.assert_allclose(trailing_mean(steps, vals, 0.0), vals)
    np.testing.assert_allclose(trailing_mean(steps, vals, 100.0), np.cumsum(vals) / np.arange(1, 6))
