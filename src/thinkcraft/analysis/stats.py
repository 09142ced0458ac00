"""Statistics for comparing RL runs over seeds, after rliable.

Agarwal, Schwarzer, Castro, Courville, Bellemare, "Deep Reinforcement Learning at the Edge of the Statistical
Precipice", NeurIPS 2021 (https://arxiv.org/abs/2108.13264; code: github.com/google-research/rliable):
report an aggregate that is robust to outlier seeds - the interquartile mean (IQM: the mean of the middle 50%
of runs) - with a 95% *stratified percentile bootstrap* confidence interval (resample runs with replacement
within each task, recompute the statistic, take the 2.5 / 97.5 percentiles), and the probability of
improvement P(X > Y) between two algorithms. rliable's own code needs `arch`; these are the same estimators
in ~60 lines of numpy, seeded, so that a comparison is reproducible.

Shapes: a score matrix is (runs, tasks); a 1-D array is one task. Pure functions; no I/O.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

Statistic = Callable[[np.ndarray], np.ndarray]
"""Maps resampled scores (reps, runs, tasks) to one value per resample (reps,)."""


class Interval(NamedTuple):
    """A point estimate and its confidence interval [low, high]."""

    point: float
    low: float
    high: float


def iqm(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Interquartile mean: the mean after dropping the lowest and highest `floor(n / 4)` values along `axis`.

    Exactly `scipy.stats.trim_mean(x, 0.25, axis)`, which rliable uses (n = 5 keeps the middle 3; n < 4 keeps
    all). NaN in, NaN out."""
    x = np.sort(np.asarray(x, dtype=np.float64), axis=axis)
    n = x.shape[axis]
    if n == 0:
        raise ValueError("iqm of an empty array")
    cut = int(0.25 * n)
    return np.take(x, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


def _as_runs_by_tasks(scores: np.ndarray) -> np.ndarray:
    x = np.asarray(scores, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"scores must be (runs,) or (runs, tasks) with at least one run, got shape {x.shape}")
    return x


def stat_iqm(resampled: np.ndarray) -> np.ndarray:
    """IQM over all runs and tasks of each resample (rliable's aggregate IQM)."""
    return iqm(resampled.reshape(resampled.shape[0], -1), axis=-1)


def stat_mean(resampled: np.ndarray) -> np.ndarray:
    return resampled.reshape(resampled.shape[0], -1).mean(axis=-1)


def bootstrap_resamples(scores: np.ndarray, reps: int, rng: np.random.Generator) -> np.ndarray:
    """(reps, runs, tasks): for each task independently (the strata), `runs` draws with replacement."""
    x = _as_runs_by_tasks(scores)
    n, m = x.shape
    idx = rng.integers(0, n, size=(reps, n, m))
    return np.take_along_axis(np.broadcast_to(x, (reps, n, m)), idx, axis=1)


def percentile_interval(samples: np.ndarray, confidence: float = 0.95, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The percentile bootstrap interval: the (1 - c)/2 and (1 + c)/2 quantiles of the bootstrap samples."""
    alpha = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(samples, [alpha, 100.0 - alpha], axis=axis)
    return low, high


def bootstrap_ci(scores: np.ndarray, statistic: Statistic = stat_iqm, reps: int = 2000,
                 confidence: float = 0.95, seed: int = 0) -> Interval:
    """`statistic` of the scores with its stratified percentile-bootstrap interval (rliable's method)."""
    x = _as_runs_by_tasks(scores)
    boot = statistic(bootstrap_resamples(x, reps, np.random.default_rng(seed)))
    low, high = percentile_interval(boot, confidence)
    return Interval(float(statistic(x[None])[0]), float(low), float(high))


def probability_of_improvement(x: np.ndarray, y: np.ndarray) -> float:
    """P(X > Y): the chance that a run of X beats a run of Y on a task (ties count half), averaged over tasks
    (rliable: the Mann-Whitney U statistic over all pairs, normalised by their number)."""
    x, y = _as_runs_by_tasks(x), _as_runs_by_tasks(y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same tasks, got {x.shape[1]} and {y.shape[1]}")
    gt = (x[:, None, :] > y[None, :, :]).mean(axis=(0, 1))
    eq = (x[:, None, :] == y[None, :, :]).mean(axis=(0, 1))
    return float((gt + 0.5 * eq).mean())


def probability_of_improvement_ci(x: np.ndarray, y: np.ndarray, reps: int = 2000, confidence: float = 0.95,
                                  seed: int = 0) -> Interval:
    """P(X > Y) with a percentile interval from resampling X's and Y's runs independently (within tasks)."""
    rng = np.random.default_rng(seed)
    bx, by = bootstrap_resamples(x, reps, rng), bootstrap_resamples(y, reps, rng)
    gt = (bx[:, :, None, :] > by[:, None, :, :]).mean(axis=(1, 2))
    eq = (bx[:, :, None, :] == by[:, None, :, :]).mean(axis=(1, 2))
    boot = (gt + 0.5 * eq).mean(axis=-1)
    low, high = percentile_interval(boot, confidence)
    return Interval(probability_of_improvement(x, y), float(low), float(high))


def bootstrap_mean_band(curves: np.ndarray, reps: int = 2000, confidence: float = 0.95,
                        seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) per column of `curves` (seeds, points): the mean over seeds and its percentile
    bootstrap band, resampling whole seeds (one resample's weights serve every point, so the band is the
    band of a curve). A resample's mean is counts @ curves / n with multinomial counts: no (reps, n, G) copy."""
    c = np.asarray(curves, dtype=np.float64)
    n = c.shape[0]
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=reps)
    boot = counts @ c / n
    low, high = percentile_interval(boot, confidence)
    return c.mean(axis=0), low, high


def interpolate_to_grid(steps: np.ndarray, values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Linear interpolation of one seed's (step, value) series at `grid`; NaN outside the series' own step
    range (no extrapolation). A repeated step keeps its last value."""
    s, v = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    last = np.r_[s[1:] != s[:-1], True]  # the last of each run of equal steps
    s, v = s[last], v[last]
    out = np.interp(grid, s, v)
    out[(grid < s[0]) | (grid > s[-1])] = np.nan
    return out


def trailing_mean(steps: np.ndarray, values: np.ndarray, window: float) -> np.ndarray:
    """Each value replaced by the mean of the values logged in the trailing `window` of steps (step - window,
    step]: puts a run logged every update on the footing of one logged per chunk of updates. Sorted steps."""
    s, v = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if window <= 0 or len(v) == 0:
        return v
    csum = np.r_[0.0, np.cumsum(v)]
    first = np.searchsorted(s, s - window, side="right")  # first index inside the window
    last = np.arange(1, len(v) + 1)
    return (csum[last] - csum[first]) / (last - first)


def common_grid(step_series: list[np.ndarray], num_points: int) -> np.ndarray:
    """`num_points` evenly spaced steps over the range every series covers: [max of firsts, min of lasts].
    Empty when the series do not overlap."""
    lo = max(float(np.min(s)) for s in step_series)
    hi = min(float(np.max(s)) for s in step_series)
    if hi < lo:
        return np.zeros(0)
    return np.linspace(lo, hi, num_points) if hi > lo else np.array([lo])


def final_value(steps: np.ndarray, values: np.ndarray, final_frac: float) -> float:
    """Mean of the values logged in the last `final_frac` of the steps: step > (1 - final_frac) × last step
    (the last record always counts)."""
    s, v = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    last = s.max()
    window = (s > (1.0 - final_frac) * last) | (s == last)
    return float(v[window].mean())
