"""Pure maths kernels of rl/: GAE, Categorical, PPO loss, the optimistic-reset assignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thinkcraft.envs.craftax import fresh_world_index
from thinkcraft.rl.distributions import Categorical
from thinkcraft.rl.gae import gae
from thinkcraft.rl.ppo import PPOHyper, Transition, ppo_loss


def gae_loop(rewards, values, dones, last_value, gamma, lam):
    T, N = rewards.shape
    adv = np.zeros((T, N))
    next_adv = np.zeros(N)
    next_v = last_value.astype(np.float64)
    for t in reversed(range(T)):
        nd = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_v * nd - values[t]
        next_adv = delta + gamma * lam * nd * next_adv
        adv[t] = next_adv
        next_v = values[t]
    return adv, adv + values


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.8), (0.9, 1.0), (1.0, 0.0)])
def test_gae_scan_equals_python_loop(gamma, lam):
    rng = np.random.default_rng(0)
    T, N = 17, 5
    r = rng.normal(size=(T, N)).astype(np.float32)
    v = rng.normal(size=(T, N)).astype(np.float32)
    d = (rng.random((T, N)) < 0.2).astype(np.float32)
    lv = rng.normal(size=N).astype(np.float32)
    adv, tgt = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(d), jnp.asarray(lv), gamma, lam)
    adv_ref, tgt_ref = gae_loop(r, v, d, lv, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), adv_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tgt), tgt_ref, rtol=1e-5, atol=1e-5)


def test_categorical_matches_reference():
    logits = jnp.array([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0], [-jnp.inf, 0.0, 1.0, -jnp.inf]])
    d = Categorical(logits)
    p = np.exp(np.asarray(logits) - np.log(np.sum(np.exp(np.asarray(logits)), -1, keepdims=True)))
    a = jnp.array([1, 3, 2])
    np.testing.assert_allclose(np.asarray(d.log_prob(a)), np.log(p[np.arange(3), [1, 3, 2]]), rtol=1e-6)
    ent_ref = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)
    np.testing.assert_allclose(np.asarray(d.entropy()), ent_ref, rtol=1e-6)
    assert np.isfinite(np.asarray(d.entropy())).all()
    np.testing.assert_array_equal(np.asarray(d.mode()), [1, 0, 2])
    # sampling frequencies follow the probabilities (and never pick a -inf logit)
    keys = jax.random.split(jax.random.PRNGKey(0), 20000)
    s = np.asarray(jax.vmap(lambda k: d.sample(seed=k))(keys))  # (20000, 3)
    for row in range(3):
        freq = np.bincount(s[:, row], minlength=4) / len(s)
        np.testing.assert_allclose(freq, p[row], atol=0.015)
    assert not np.isin(s[:, 2], [0, 3]).any()


def test_ppo_loss_on_hand_built_batch():
    """A one-parameter 'network' (logits and value given directly) against a numpy recomputation."""
    hp = PPOHyper(clip_eps=0.2, ent_coef=0.01, vf_coef=0.5)
    logits = np.array([[0.5, -0.5], [1.0, 0.0], [0.0, 2.0], [0.3, 0.3]], np.float32)
    values = np.array([0.5, -0.2, 1.5, 0.0], np.float32)

    def apply_fn(params, obs):
        return Categorical(params["logits"][obs]), params["values"][obs]

    params = {"logits": jnp.asarray(logits), "values": jnp.asarray(values)}
    old_logp = np.array([-0.9, -0.1, -2.5, -0.7], np.float32)
    batch = Transition(
        obs=jnp.arange(4), action=jnp.array([0, 0, 0, 1]), log_prob=jnp.asarray(old_logp),
        value=jnp.array([0.4, 0.3, 1.0, 0.1]), reward=jnp.zeros(4), done=jnp.zeros(4),
    )
    adv = np.array([1.0, -0.5, 2.0, 0.25], np.float32)
    tgt = np.array([1.0, 0.0, 1.0, -1.0], np.float32)
    loss, aux = ppo_loss(params, apply_fn, batch, jnp.asarray(adv), jnp.asarray(tgt), hp)

    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = logp_all[np.arange(4), [0, 0, 0, 1]]
    ratio = np.exp(logp - old_logp)
    an = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = -np.minimum(ratio * an, np.clip(ratio, 0.8, 1.2) * an).mean()
    old_v = np.array([0.4, 0.3, 1.0, 0.1])
    v_clip = old_v + np.clip(values - old_v, -0.2, 0.2)
    vl = 0.5 * np.maximum((values - tgt) ** 2, (v_clip - tgt) ** 2).mean()
    ent = -(np.exp(logp_all) * logp_all).sum(-1).mean()
    np.testing.assert_allclose(float(aux["losses/policy"]), pg, rtol=1e-5)
    np.testing.assert_allclose(float(aux["losses/value"]), vl, rtol=1e-5)
    np.testing.assert_allclose(float(aux["losses/entropy"]), ent, rtol=1e-5)
    np.testing.assert_allclose(float(loss), pg + 0.5 * vl - 0.01 * ent, rtol=1e-5)
    # clipping is active for at least one sample, so the test exercises the clipped branch
    assert (np.abs(ratio - 1) > 0.2).any()


def test_fresh_world_index_is_unique_for_the_first_k_done():
    rng = np.random.default_rng(1)
    for trial in range(50):
        n, k = 64, 4
        done = rng.random(n) < rng.choice([0.0, 0.02, 0.05, 0.2])
        idx = np.asarray(fresh_world_index(jnp.asarray(done), k, jax.random.PRNGKey(trial)))
        assert ((idx >= 0) & (idx < k)).all()
        got = idx[done]
        if done.sum() <= k:  # every done env gets its own fresh world
            assert len(set(got.tolist())) == done.sum()
        else:  # all k fresh worlds are used, shared only beyond k
            assert set(got.tolist()) == set(range(k))
    # no done env: nothing is NaN or out of range (the jax.random.choice failure mode)
    idx = np.asarray(fresh_world_index(jnp.zeros(8, bool), 2, jax.random.PRNGKey(0)))
    assert (idx == 0).all()
