"""Property tests (hypothesis) for the advantage estimators, and a large-batch run.

What shift invariance actually holds, stated precisely. Add a constant c to every step reward of one group g:
- A trajectory's return R = sum_t r_t moves by c * L (its length). So the mean_norm episode advantage moves by
  c * (L_i - mean_{j in g} L_j): unchanged exactly when all trajectories of g have the same length. (Adding c to
  each trajectory's *return*, e.g. to its last step's reward only, leaves it unchanged for any lengths, and the
  mean_std_norm one too, since the std does not move either.)
- A row's discounted return-to-go moves by c * S(k), where k = L - t is the number of steps left including this
  one and S(k) = 1 + gamma + ... + gamma^(k-1). So the mean_norm step advantage moves by
  c * (S(k_row) - mean over its step group of S(k)): unchanged when every row of the step group has the same number
  of steps left (e.g. equal lengths and anchors that only repeat at the same time step), or when gamma = 0 (S = 1).
  In general GiGPO with discounting is NOT invariant, even with equal lengths, because one anchor can be met at
  different times.
The tests check these formulas exactly, and the invariant special cases as corollaries.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import (
    ESTIMATORS,
    compute_drgrpo_advantages,
    compute_gae_advantages,
    compute_gigpo_advantages,
    compute_grpo_advantages,
    dynamic_sampling_mask,
)

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, equal_lengths: bool = False, anchors_by_time: bool = False, max_groups: int = 4):
    """A small random batch: groups of 1-4 trajectories of 1-6 steps, rewards in [-5, 5], anchors from a small pool
    (so they repeat across and within trajectories), and rows interleaved at random."""
    n_groups = draw(st.integers(1, max_groups))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    group, traj, anchor, step = [], [], [], []
    for g in range(n_groups):
        n_traj = draw(st.integers(1, 4))
        fixed_length = int(rng.integers(1, 7))
        for k in range(n_traj):
            length = fixed_length if equal_lengths else int(rng.integers(1, 7))
            for t in range(length):
                state = int(rng.integers(0, 3))
                group.append(f"g{g}")
                traj.append(k)
                anchor.append(f"t{t}-s{state}" if anchors_by_time else f"s{state}")
                step.append(t)
    n = len(group)
    rewards = np.round(rng.uniform(-5, 5, size=n), 3)
    order = _interleave(np.array([f"{g}/{k}" for g, k in zip(group, traj, strict=True)]), rng)
    return {
        "group_ids": np.array(group, dtype=object)[order],
        "traj_ids": np.array(traj)[order],
        "anchor_keys": np.array(anchor, dtype=object)[order],
        "step_rewards": rewards[order],
    }


def _interleave(traj_keys: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random row order in which each trajectory's rows keep their relative (time) order."""
    priority = rng.random(len(traj_keys))
    for key in set(traj_keys.tolist()):
        rows = np.flatnonzero(traj_keys == key)
        priority[rows] = np.sort(priority[rows])  # earlier steps get smaller priorities, so they come first
    return np.argsort(priority)


def _lengths_and_steps_left(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its trajectory's length, and the steps left including this one (computed the slow, obvious way)."""
    keys = [f"{g}/{k}" for g, k in zip(batch["group_ids"], batch["traj_ids"], strict=True)]
    total = {key: keys.count(key) for key in set(keys)}
    seen: dict[str, int] = {}
    lengths, left = [], []
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
        lengths.append(total[key])
        left.append(total[key] - seen[key] + 1)
    return np.array(lengths, dtype=float), np.array(left, dtype=float)


def _centred(values: np.ndarray, keys: list) -> np.ndarray:
    """values minus the mean of their key's values; 0 where the key occurs once (the slow, obvious way)."""
    out = np.zeros(len(values))
    for key in set(keys):
        rows = [i for i, k in enumerate(keys) if k == key]
        if len(rows) > 1:
            out[rows] = values[rows] - values[rows].mean()
    return out


def _shift_group(batch: dict, group: str, c: float) -> dict:
    shifted = dict(batch)
    shifted["step_rewards"] = batch["step_rewards"] + c * (batch["group_ids"] == group)
    return shifted


def _traj_mean(batch: dict, per_row: np.ndarray) -> np.ndarray:
    """Per-row centring of a per-trajectory quantity within the group, each trajectory counted once."""
    keys = [f"{g}/{k}" for g, k in zip(batch["group_ids"], batch["traj_ids"], strict=True)]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    traj_rows = list(first.values())
    traj_values = per_row[traj_rows]
    traj_groups = [batch["group_ids"][i] for i in traj_rows]
    centred = dict(zip(first, _centred(traj_values, traj_groups), strict=True))
    return np.array([centred[k] for k in keys])


# ------------------------------------------------------------------------------------------------------------------
@SETTINGS
@given(batches(), st.floats(-3, 3))
def test_shift_moves_episode_advantage_by_length_difference(batch, c):
    g = batch["group_ids"][0]
    lengths, _ = _lengths_and_steps_left(batch)
    before = compute_drgrpo_advantages(batch["group_ids"], batch["traj_ids"], batch["step_rewards"])
    after = compute_drgrpo_advantages(batch["group_ids"], batch["traj_ids"], _shift_group(batch, g, c)["step_rewards"])
    expected = c * (batch["group_ids"] == g) * _traj_mean(batch, lengths)
    np.testing.assert_allclose(after - before, expected, atol=1e-4)


@SETTINGS
@given(batches(equal_lengths=True), st.floats(-3, 3))
def test_shift_leaves_episode_advantage_unchanged_for_equal_lengths(batch, c):
    shifted = _shift_group(batch, batch["group_ids"][0], c)
    for fn in (compute_drgrpo_advantages, compute_grpo_advantages):
        before = fn(batch["group_ids"], batch["traj_ids"], batch["step_rewards"])
        after = fn(shifted["group_ids"], shifted["traj_ids"], shifted["step_rewards"])
        np.testing.assert_allclose(after, before, atol=2e-3)


@SETTINGS
@given(batches(), st.floats(-3, 3), st.sampled_from([0.0, 0.5, 0.95, 1.0]))
def test_gigpo_shift_formula(batch, c, gamma):
    g = batch["group_ids"][0]
    lengths, left = _lengths_and_steps_left(batch)
    s_of_k = left if gamma == 1.0 else (1 - gamma**left) / (1 - gamma)  # S(k) = 1 + gamma + ... + gamma^(k-1)
    step_keys = [f"{gr}|{a}" for gr, a in zip(batch["group_ids"], batch["anchor_keys"], strict=True)]
    in_g = batch["group_ids"] == g
    expected = c * in_g * (_traj_mean(batch, lengths) + _centred(s_of_k, step_keys))
    before = compute_gigpo_advantages(**batch, gamma=gamma)
    after = compute_gigpo_advantages(**_shift_group(batch, g, c), gamma=gamma)
    np.testing.assert_allclose(after - before, expected, atol=2e-4)


@SETTINGS
@given(batches(equal_lengths=True, anchors_by_time=True), st.floats(-3, 3))
def test_gigpo_invariant_when_lengths_and_steps_left_match(batch, c):
    shifted = _shift_group(batch, batch["group_ids"][0], c)
    np.testing.assert_allclose(compute_gigpo_advantages(**shifted), compute_gigpo_advantages(**batch), atol=2e-4)


@SETTINGS
@given(batches(equal_lengths=True), st.floats(-3, 3))
def test_gigpo_invariant_with_gamma_zero_and_equal_lengths(batch, c):
    shifted = _shift_group(batch, batch["group_ids"][0], c)
    np.testing.assert_allclose(
        compute_gigpo_advantages(**shifted, gamma=0.0), compute_gigpo_advantages(**batch, gamma=0.0), atol=2e-4
    )


@SETTINGS
@given(batches(), st.sampled_from(["mean_norm", "mean_std_norm"]))
def test_gigpo_without_repeated_anchors_is_episode_level(batch, mode):
    unique = dict(batch, anchor_keys=np.arange(len(batch["step_rewards"])))
    episode = compute_drgrpo_advantages if mode == "mean_norm" else compute_grpo_advantages
    np.testing.assert_allclose(
        compute_gigpo_advantages(**unique, mode=mode),
        episode(batch["group_ids"], batch["traj_ids"], batch["step_rewards"]),
        atol=1e-6,
    )


@SETTINGS
@given(batches(), st.integers(0, 2**32 - 1))
def test_permuting_rows_permutes_outputs(batch, seed):
    rng = np.random.default_rng(seed)
    keys = np.array([f"{g}/{k}" for g, k in zip(batch["group_ids"], batch["traj_ids"], strict=True)])
    order = _interleave(keys, rng)
    permuted = {k: v[order] for k, v in batch.items()}
    for name, fn in ESTIMATORS.items():
        for params in ({}, {"mode": "mean_std_norm"}) if name == "gigpo" else ({},):
            full = fn(batch["group_ids"], batch["traj_ids"], batch["anchor_keys"], batch["step_rewards"], **params)
            perm = fn(
                permuted["group_ids"], permuted["traj_ids"], permuted["anchor_keys"], permuted["step_rewards"], **params
            )
            np.testing.assert_allclose(perm, full[order], atol=1e-6, err_msg=name)
    values = np.linspace(-1, 1, len(order))
    adv, ret = compute_gae_advantages(batch["group_ids"], batch["traj_ids"], batch["step_rewards"], values)
    adv_p, ret_p = compute_gae_advantages(
        permuted["group_ids"], permuted["traj_ids"], permuted["step_rewards"], values[order]
    )
    np.testing.assert_allclose(adv_p, adv[order], atol=1e-5)
    np.testing.assert_allclose(ret_p, ret[order], atol=1e-5)
    np.testing.assert_array_equal(
        dynamic_sampling_mask(permuted["group_ids"], permuted["traj_ids"], permuted["step_rewards"]),
        dynamic_sampling_mask(batch["group_ids"], batch["traj_ids"], batch["step_rewards"])[order],
    )


@SETTINGS
@given(batches(), st.sampled_from([1.0, 1e-3, 1e6]))
def test_outputs_are_float32_and_finite(batch, scale):
    scaled = dict(batch, step_rewards=batch["step_rewards"] * scale)
    for name, fn in ESTIMATORS.items():
        out = fn(scaled["group_ids"], scaled["traj_ids"], scaled["anchor_keys"], scaled["step_rewards"])
        assert out.dtype == np.float32 and out.shape == scaled["step_rewards"].shape, name
        assert np.isfinite(out).all(), name
    out = compute_gigpo_advantages(**scaled, mode="mean_std_norm")
    assert out.dtype == np.float32 and np.isfinite(out).all()


def test_interleave_helper_keeps_time_order():
    keys = np.array(["a", "a", "b", "a", "b"])
    order = _interleave(keys, np.random.default_rng(3))
    assert sorted(order) == list(range(5))
    for key in ("a", "b"):
        rows = [int(r) for r in order if keys[r] == key]
        assert rows == sorted(rows)


def test_large_batch_completes():
    # 200k rows, 8 trajectories a group, lengths 1..50, anchors from a 20-state pool per group. No timing asserted:
    # this only shows the vectorized path handles a large batch (a quadratic one would not finish in the suite).
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 51, size=8 * 1000)
    traj = np.repeat(np.arange(len(lengths)), lengths)[:200_000]
    group = traj // 8
    anchors = group * 100 + rng.integers(0, 20, size=len(traj))
    rewards = rng.normal(size=len(traj))
    for mode in ("mean_norm", "mean_std_norm"):
        out = compute_gigpo_advantages(group, traj, anchors, rewards, mode=mode)
        assert out.shape == (len(traj),) and out.dtype == np.float32 and np.isfinite(out).all()
