"""Hand-computed examples for the advantage estimators, GAE, the DAPO filter and the invalid-action penalty."""

from __future__ import annotations

import math

import numpy as np
import pytest

from algorithms import (
    ESTIMATORS,
    apply_invalid_action_penalty,
    compute_advantages,
    compute_drgrpo_advantages,
    compute_gae_advantages,
    compute_gigpo_advantages,
    compute_grpo_advantages,
    compute_hgpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    dynamic_sampling_mask,
    step_group_stats,
)
from algorithms.core import Moments, discounted_returns_to_go, factorize, stable_argsort_codes, trajectory_layout
from algorithms.reinforce_pp import reinforce_pp_values, whiten

# ------------------------------------------------------------------------------------------------------------------
# The worked example (gamma = 0.5 keeps the arithmetic exact).
#   group "g1": trajectory 0 (A): anchors s, t, s   rewards 0, 0, 1   return 1   returns-to-go .25, .5, 1
#               trajectory 1 (B): anchors s, u      rewards 0, 2      return 2   returns-to-go 1, 2
#               trajectory 2 (C): anchors t         rewards 0         return 0   returns-to-go 0
#   group "g2": trajectory 0 (D): anchors s, s      rewards 1, 1      return 2   returns-to-go 1.5, 1
# D reuses trajectory id 0 and anchor "s" of group g1: neither may be confused with g1's.
# Rows are interleaved: B0 A0 D0 A1 C0 B1 A2 D1.
# ------------------------------------------------------------------------------------------------------------------
ROWS = ["B0", "A0", "D0", "A1", "C0", "B1", "A2", "D1"]
GROUP = {"A": "g1", "B": "g1", "C": "g1", "D": "g2"}
TRAJ = {"A": 0, "B": 1, "C": 2, "D": 0}
ANCHOR = {"A0": "s", "A1": "t", "A2": "s", "B0": "s", "B1": "u", "C0": "t", "D0": "s", "D1": "s"}
REWARD = {"A0": 0, "A1": 0, "A2": 1, "B0": 0, "B1": 2, "C0": 0, "D0": 1, "D1": 1}


def example() -> dict:
    return {
        "group_ids": [GROUP[r[0]] for r in ROWS],
        "traj_ids": [TRAJ[r[0]] for r in ROWS],
        "anchor_keys": [ANCHOR[r] for r in ROWS],
        "step_rewards": [float(REWARD[r]) for r in ROWS],
    }


def by_row(values: dict[str, float]) -> np.ndarray:
    return np.array([values[r] for r in ROWS])


def test_gigpo_mean_norm_hand_computed():
    # Episode: g1 returns (1, 2, 0), mean 1 -> A 0, B +1, C -1; g2 has one trajectory -> 0.
    # Step groups: g1/s = {A0 .25, A2 1, B0 1}, mean .75 -> -.5, +.25, +.25
    #              g1/t = {A1 .5, C0 0}, mean .25 -> +.25, -.25;  g1/u = {B1} singleton -> 0
    #              g2/s = {D0 1.5, D1 1} (repeat within one trajectory), mean 1.25 -> +.25, -.25
    expected = {"A0": -0.5, "A1": 0.25, "A2": 0.25, "B0": 1.25, "B1": 1.0, "C0": -1.25, "D0": 0.25, "D1": -0.25}
    adv = compute_gigpo_advantages(**example(), gamma=0.5, mode="mean_norm")
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, by_row(expected), atol=1e-6)


def test_gigpo_mean_std_norm_hand_computed():
    # Episode: g1 returns (1, 2, 0): mean 1, unbiased std 1 -> A 0, B +1, C -1 (up to eps); g2 -> 0.
    # g1/s: (.25, 1, 1), deviations (-.5, .25, .25), unbiased var (.25 + .0625 + .0625) / 2 = .1875
    # g1/t: (.5, 0) and g2/s: (1.5, 1): deviations +-.25, std sqrt(.125) -> +-1/sqrt(2)
    s = math.sqrt(0.1875)
    h = 1 / math.sqrt(2)
    expected = {
        "A0": 0 - 0.5 / s,
        "A1": 0 + h,
        "A2": 0 + 0.25 / s,
        "B0": 1 + 0.25 / s,
        "B1": 1 + 0.0,
        "C0": -1 - h,
        "D0": h,
        "D1": -h,
    }
    adv = compute_gigpo_advantages(**example(), gamma=0.5, mode="mean_std_norm")
    np.testing.assert_allclose(adv, by_row(expected), rtol=1e-5, atol=1e-5)


def test_gigpo_step_weight_and_gamma_zero():
    # gamma = 0: the return-to-go is the step reward itself. g1/s = (0, 1, 0) mean 1/3; g1/t = (0, 0); g2/s = (1, 1).
    adv = compute_gigpo_advantages(**example(), gamma=0.0, step_weight=2.0)
    expected = {"A0": -2 / 3, "A1": 0.0, "A2": 4 / 3, "B0": 1 - 2 / 3, "B1": 1.0, "C0": -1.0, "D0": 0.0, "D1": 0.0}
    np.testing.assert_allclose(adv, by_row(expected), atol=1e-6)
    episode_only = compute_gigpo_advantages(**example(), step_weight=0.0)
    np.testing.assert_allclose(episode_only, compute_drgrpo_advantages(**_no_anchor(example())), atol=1e-7)


def test_gigpo_all_singletons_is_zero():
    # Every trajectory alone in its group, every anchor distinct: nothing to compare with.
    adv = compute_gigpo_advantages([0, 1, 2], [0, 0, 0], ["a", "b", "c"], [1.0, 5.0, -3.0], mode="mean_std_norm")
    np.testing.assert_array_equal(adv, np.zeros(3, dtype=np.float32))


def test_gigpo_accepts_arrays_of_ints_objects_and_tuples():
    ex = example()
    base = compute_gigpo_advantages(**ex, gamma=0.5)
    codes = {"g1": 7, "g2": 9}
    as_ints = compute_gigpo_advantages(
        np.array([codes[g] for g in ex["group_ids"]]),
        np.array(ex["traj_ids"]),
        np.array([ord(a) for a in ex["anchor_keys"]]),
        np.array(ex["step_rewards"], dtype=np.float32),
        gamma=0.5,
    )
    as_unicode_array = compute_gigpo_advantages(
        np.array(ex["group_ids"]), np.array(ex["traj_ids"]), np.array(ex["anchor_keys"]), ex["step_rewards"], gamma=0.5
    )
    as_tuples = compute_gigpo_advantages(
        [(g, "x") for g in ex["group_ids"]],
        ex["traj_ids"],
        [(a, 1) for a in ex["anchor_keys"]],
        ex["step_rewards"],
        gamma=0.5,
    )
    for other in (as_ints, as_unicode_array, as_tuples):
        np.testing.assert_array_equal(other, base)


def test_gigpo_validation_errors():
    ex = example()
    with pytest.raises(ValueError, match="mode"):
        compute_gigpo_advantages(**ex, mode="std")
    with pytest.raises(ValueError, match="lengths"):
        compute_gigpo_advantages(ex["group_ids"], ex["traj_ids"], ex["anchor_keys"][:-1], ex["step_rewards"])
    with pytest.raises(ValueError, match="lengths"):
        compute_gigpo_advantages(ex["group_ids"][:-1], ex["traj_ids"], ex["anchor_keys"], ex["step_rewards"])
    with pytest.raises(ValueError, match="NaN"):
        compute_gigpo_advantages(ex["group_ids"], ex["traj_ids"], ex["anchor_keys"], [math.nan] * len(ROWS))
    with pytest.raises(ValueError, match="anchor_similarity"):
        compute_gigpo_advantages(**ex, anchor_similarity=0.0)
    with pytest.raises(ValueError, match="hashable"):
        compute_gigpo_advantages(ex["group_ids"], ex["traj_ids"], [[1]] * len(ROWS), ex["step_rewards"])
    with pytest.raises(ValueError, match="anchor_keys is required"):
        compute_advantages("gigpo", ex["group_ids"], ex["traj_ids"], None, ex["step_rewards"])
    with pytest.raises(ValueError, match="gamma"):
        compute_gigpo_advantages(**ex, gamma=1.5)


def test_gigpo_empty_batch():
    assert compute_gigpo_advantages([], [], [], []).shape == (0,)


def test_step_group_stats():
    ex = example()
    stats = step_group_stats(ex["group_ids"], ex["anchor_keys"])
    # Step groups: g1/s (3 rows), g1/t (2), g1/u (1), g2/s (2): 7 of 8 rows share, 8 rows / 4 groups.
    assert stats == {"step_group_share": 7 / 8, "step_group_mean_size": 2.0, "num_step_groups": 4.0}
    assert step_group_stats([], [])["num_step_groups"] == 0.0


# ------------------------------------------------------------------------------------------------------------------
# Similarity-based anchors
# ------------------------------------------------------------------------------------------------------------------
def _noisy_copies(base: str, n: int, rng: np.random.Generator) -> list[str]:
    out = []
    for _ in range(n):
        i = int(rng.integers(0, len(base)))
        out.append(base[:i] + "#" + base[i + 1 :])  # one character changed
    return out


def test_similar_anchors_share_a_step_group_within_a_group_only():
    rng = np.random.default_rng(0)
    alphabet = list("abcdefghij .,")
    bases = ["".join(rng.choice(alphabet, 150)) for _ in range(3)]  # unrelated texts: Jaccard ~ 0
    groups, anchors, truth = [], [], []
    for g in range(2):
        for b, base in enumerate(bases):
            copies = _noisy_copies(base, 5, rng)
            groups += [g] * len(copies)
            anchors += copies
            truth += [(g, b)] * len(copies)
    stats = step_group_stats(groups, anchors, anchor_similarity=0.8)
    assert stats["num_step_groups"] == 6  # 3 texts x 2 groups, never merged across groups
    assert step_group_stats(groups, anchors)["num_step_groups"] > 6  # exact matching sees the noise
    # The step advantages follow the true clusters: one-step trajectories, so A_S = r - mean of the cluster.
    rewards = rng.normal(size=len(anchors))
    traj = list(range(len(anchors)))
    adv = compute_gigpo_advantages(groups, traj, anchors, rewards, anchor_similarity=0.8)
    cluster, _ = factorize([str(t) for t in truth])
    cluster_mean = np.bincount(cluster, weights=rewards) / np.bincount(cluster)
    expected = compute_drgrpo_advantages(groups, traj, rewards) + (rewards - cluster_mean[cluster])
    np.testing.assert_allclose(adv, expected, atol=1e-5)


def test_similarity_one_is_exact_and_strings_are_required():
    ex = example()
    np.testing.assert_array_equal(compute_gigpo_advantages(**ex, anchor_similarity=1.0), compute_gigpo_advantages(**ex))
    with pytest.raises(ValueError, match="string"):
        compute_gigpo_advantages(
            ex["group_ids"], ex["traj_ids"], list(range(len(ROWS))), ex["step_rewards"], anchor_similarity=0.9
        )


def test_similarity_keeps_identical_texts_together_and_short_texts_work():
    groups = [0, 0, 0, 0, 1]
    anchors = ["ab", "ab", "x", "", ""]
    stats = step_group_stats(groups, anchors, anchor_similarity=0.9)
    assert stats["num_step_groups"] == 4  # {ab, ab}, {x}, {""} in group 0, {""} in group 1


# ------------------------------------------------------------------------------------------------------------------
# Episode-level estimators on the worked example: returns g1 = (A 1, B 2, C 0), g2 = (D 2).
# ------------------------------------------------------------------------------------------------------------------
def _no_anchor(ex: dict) -> dict:
    return {k: v for k, v in ex.items() if k != "anchor_keys"}


def test_grpo_and_drgrpo_hand_computed():
    # g1: mean 1, unbiased std 1; g2 alone -> 0.
    expected = by_row({"A0": 0, "A1": 0, "A2": 0, "B0": 1, "B1": 1, "C0": -1, "D0": 0, "D1": 0})
    np.testing.assert_allclose(compute_grpo_advantages(**_no_anchor(example())), expected / (1 + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(compute_drgrpo_advantages(**_no_anchor(example())), expected, atol=0)
    # A second group where std != 1: returns 1 and 3 -> mean 2, std sqrt(2).
    adv = compute_grpo_advantages(["x"] * 3, [0, 1, 1], [1.0, 1.0, 2.0])
    np.testing.assert_allclose(adv, [-1 / math.sqrt(2), 1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-5)
    np.testing.assert_allclose(compute_drgrpo_advantages(["x"] * 3, [0, 1, 1], [1.0, 1.0, 2.0]), [-1, 1, 1])


def test_rloo_hand_computed():
    # A: 1 - (2 + 0) / 2 = 0;  B: 2 - (1 + 0) / 2 = 1.5;  C: 0 - (1 + 2) / 2 = -1.5;  D alone -> 0.
    expected = by_row({"A0": 0, "A1": 0, "A2": 0, "B0": 1.5, "B1": 1.5, "C0": -1.5, "D0": 0, "D1": 0})
    np.testing.assert_allclose(compute_rloo_advantages(**_no_anchor(example())), expected, atol=1e-7)


def test_reinforce_pp_hand_computed():
    # Batch returns (A 1, B 2, C 0, D 2): mean 1.25, unbiased var (.0625 + .5625 + 1.5625 + .5625) / 3 = 11/12.
    sd = math.sqrt(11 / 12)
    plain = {"A": (1 - 1.25) / sd, "B": 0.75 / sd, "C": -1.25 / sd, "D": 0.75 / sd}
    adv = compute_reinforce_pp_advantages(**_no_anchor(example()))
    np.testing.assert_allclose(adv, [plain[r[0]] for r in ROWS], rtol=1e-5)
    # Baseline: minus the group mean -> (A 0, B 1, C -1, D 0); batch mean 0, unbiased std sqrt(2/3).
    sd = math.sqrt(2 / 3)
    centred = {"A": 0.0, "B": 1 / sd, "C": -1 / sd, "D": 0.0}
    adv = compute_reinforce_pp_advantages(**_no_anchor(example()), baseline=True)
    np.testing.assert_allclose(adv, [centred[r[0]] for r in ROWS], rtol=1e-5, atol=1e-7)
    # One trajectory in the whole batch: 0.
    np.testing.assert_array_equal(compute_reinforce_pp_advantages([0, 0], [0, 0], [1.0, 2.0]), [0, 0])


def test_registry_and_dispatch():
    assert set(ESTIMATORS) == {"gigpo", "hgpo", "grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    ex = example()
    np.testing.assert_array_equal(
        compute_advantages("gigpo", **ex, gamma=0.5), compute_gigpo_advantages(**ex, gamma=0.5)
    )
    np.testing.assert_array_equal(compute_advantages("grpo", **ex), compute_grpo_advantages(**_no_anchor(ex)))
    np.testing.assert_array_equal(
        compute_advantages("reinforce_pp_baseline", **ex),
        compute_reinforce_pp_advantages(**_no_anchor(ex), baseline=True),
    )
    for name, fn in ESTIMATORS.items():
        out = fn(ex["group_ids"], ex["traj_ids"], ex["anchor_keys"], ex["step_rewards"])
        assert out.dtype == np.float32 and out.shape == (len(ROWS),), name
    with pytest.raises(ValueError, match="'gigpo'.*'grpo'"):
        compute_advantages("ppo", **ex)


# ------------------------------------------------------------------------------------------------------------------
# Returns-to-go, GAE
# ------------------------------------------------------------------------------------------------------------------
def test_discounted_returns_to_go_interleaved():
    traj = np.array([1, 0, 1, 0, 1])  # trajectory 0: rows 1, 3; trajectory 1: rows 0, 2, 4
    rewards = np.array([1.0, 2.0, 0.0, 4.0, 8.0])
    codes, n_traj = factorize(traj)
    position, next_row, length = trajectory_layout(codes, n_traj)
    np.testing.assert_array_equal(position, [0, 0, 1, 1, 2])
    np.testing.assert_array_equal(next_row, [2, 3, 4, -1, -1])
    np.testing.assert_array_equal(length, [2, 3])
    rtg = discounted_returns_to_go(rewards, 0.5, position, next_row)
    # trajectory 1: 1 + .5 * (0 + .5 * 8) = 3, 0 + .5 * 8 = 4, 8;  trajectory 0: 2 + .5 * 4 = 4, 4
    np.testing.assert_allclose(rtg, [3.0, 4.0, 4.0, 4.0, 8.0])


def _gae_reference(traj, rewards, values, bootstrap, gamma, lam):
    """Textbook GAE, one trajectory at a time, with a plain backwards loop."""
    adv = np.zeros(len(rewards))
    for t_id in dict.fromkeys(traj):
        rows = [i for i, t in enumerate(traj) if t == t_id]
        running = 0.0
        for k in reversed(range(len(rows))):
            i = rows[k]
            next_value = values[rows[k + 1]] if k + 1 < len(rows) else bootstrap[i]
            delta = rewards[i] + gamma * next_value - values[i]
            running = delta + gamma * lam * running
            adv[i] = running
    return adv, adv + values


@pytest.mark.parametrize("with_bootstrap", [False, True])
def test_gae_matches_reference_loop(with_bootstrap):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 9, size=12)
    traj = np.repeat(np.arange(12), lengths)
    rng.shuffle(traj)  # interleave; a trajectory's rows keep their relative order, which is its time order
    n = len(traj)
    rewards, values = rng.normal(size=n), rng.normal(size=n)
    bootstrap = rng.normal(size=n) if with_bootstrap else np.zeros(n)
    adv, ret = compute_gae_advantages(
        np.zeros(n, dtype=int),
        traj,
        rewards,
        values,
        gamma=0.9,
        lam=0.8,
        bootstrap_values=bootstrap if with_bootstrap else None,
    )
    ref_adv, ref_ret = _gae_reference(list(traj), rewards, values, bootstrap, 0.9, 0.8)
    assert adv.dtype == ret.dtype == np.float32
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_lambda_one_is_return_minus_value():
    # lam = 1: A_t = sum_k gamma^k r_{t+k} - V(s_t) (Monte Carlo return minus the baseline).
    adv, ret = compute_gae_advantages([0, 0, 0], [0, 0, 0], [1.0, 0.0, 2.0], [0.5, 0.5, 0.5], gamma=0.5, lam=1.0)
    np.testing.assert_allclose(ret, [1 + 0.25 * 2, 1.0, 2.0])
    np.testing.assert_allclose(adv, ret - 0.5)


def test_gae_validation():
    with pytest.raises(ValueError, match="lengths"):
        compute_gae_advantages([0, 0], [0, 0], [1.0, 2.0], [0.0])


# ------------------------------------------------------------------------------------------------------------------
# DAPO filter, invalid-action penalty
# ------------------------------------------------------------------------------------------------------------------
def test_dynamic_sampling_mask():
    groups = ["mixed", "mixed", "mixed", "solo", "same", "same", "same"]
    trajs = [0, 0, 1, 0, 0, 1, 1]
    rewards = [0.0, 1.0, 0.0, 5.0, 1.0, 0.5, 0.5]  # returns: mixed (1, 0); solo (5); same (1, 1)
    np.testing.assert_array_equal(
        dynamic_sampling_mask(groups, trajs, rewards), [True, True, True, False, False, False, False]
    )
    # Returns 1 and 1.05 differ by less than atol -> dropped.
    np.testing.assert_array_equal(dynamic_sampling_mask([0, 0], [0, 1], [1.0, 1.05], atol=0.1), [False, False])


def test_invalid_action_penalty():
    out = apply_invalid_action_penalty(np.array([1.0, 0.0, 0.0], dtype=np.float32), np.array([True, False, True]))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [1.0, -0.1, 0.0])
    np.testing.assert_allclose(apply_invalid_action_penalty([0, 0], [False, False], penalty=0.5), [-0.5, -0.5])
    with pytest.raises(ValueError, match="equal length"):
        apply_invalid_action_penalty([0.0, 1.0], [True])
    with pytest.raises(ValueError, match="boolean"):
        apply_invalid_action_penalty([0.0], [1])
    with pytest.raises(ValueError, match="penalty"):
        apply_invalid_action_penalty([0.0], [True], penalty=-1)


# ------------------------------------------------------------------------------------------------------------------
# core helpers
# ------------------------------------------------------------------------------------------------------------------
def _same_partition(codes: np.ndarray, expected: list) -> bool:
    pairs = set(zip(codes.tolist(), expected, strict=True))
    return len(pairs) == len(set(codes.tolist())) == len(set(expected))


def test_factorize_paths():
    # Dict semantics on mixed objects: 1 == 1.0 share a code; "1" and (1,) do not.
    codes, n = factorize([1, "1", (1,), 1.0, "1"])
    assert n == 3 and _same_partition(codes, ["a", "b", "c", "a", "b"])
    # NaN keys defeat the hash check (nan != nan) and take the exact fallback.
    nan = float("nan")
    codes, n = factorize(np.array(["x", nan, "x"], dtype=object))
    assert codes[0] == codes[2] and codes[1] != codes[0]
    # Small-range ints (lookup table), wide-range ints (np.unique), floats, unicode arrays.
    for values in ([5, 3, 5, 9], [10**15, 3, 10**15, -(10**15)], [0.5, 0.25, 0.5, 1.0], ["b", "a", "b", "c"]):
        codes, n = factorize(np.array(values))
        assert n == 3 and _same_partition(codes, [0, 1, 0, 2]), values
    with pytest.raises(ValueError, match="one-dimensional"):
        factorize(np.zeros((2, 2)))


@pytest.mark.parametrize("high", [50, 70_000, 2**40])
def test_stable_argsort_codes_matches_numpy(high):
    codes = np.random.default_rng(0).integers(0, high, size=5000)
    np.testing.assert_array_equal(stable_argsort_codes(codes), np.argsort(codes, kind="stable"))


def test_tensor_ids_are_read_by_value():
    torch = pytest.importorskip("torch")
    ex = example()
    codes = {"g1": 0, "g2": 1}
    adv = compute_gigpo_advantages(
        torch.tensor([codes[g] for g in ex["group_ids"]]),
        torch.tensor(ex["traj_ids"]),
        torch.tensor([ord(a) for a in ex["anchor_keys"]]),
        torch.tensor(ex["step_rewards"]),
        gamma=0.5,
    )
    np.testing.assert_array_equal(adv, compute_gigpo_advantages(**ex, gamma=0.5))


def test_gigpo_singleton_reference_keeps_a_lone_trajectorys_return():
    # g2 holds one trajectory (D, return 2): "zero" gives it A_E = 0, "reference" its raw return, as the public code.
    zero = compute_gigpo_advantages(**example(), gamma=0.5, mode="mean_norm")
    reference = compute_gigpo_advantages(**example(), gamma=0.5, mode="mean_norm", singleton="reference")
    d = [i for i, r in enumerate(ROWS) if r[0] == "D"]
    others = [i for i, r in enumerate(ROWS) if r[0] != "D"]
    np.testing.assert_allclose(reference[d], zero[d] + 2.0, atol=1e-6)
    np.testing.assert_array_equal(reference[others], zero[others])
    with pytest.raises(ValueError, match="singleton"):
        compute_gigpo_advantages(**example(), singleton="raw")


# HGPO's worked example: one group, gamma 0.5, three trajectories that share states and pasts differently.
#   P: anchors x, y, z  rewards 0, 0, 1  returns-to-go .25, .5, 1
#   Q: anchors w, y, z  rewards 0, 0, 0  returns-to-go 0, 0, 0
#   R: anchors x, y, q  rewards 0, 0, 2  returns-to-go .5, 1, 2
H_ROWS = ["P0", "P1", "P2", "Q0", "Q1", "Q2", "R0", "R1", "R2"]
H_ANCHOR = {"P": "xyz", "Q": "wyz", "R": "xyq"}
H_REWARD = {"P": (0, 0, 1), "Q": (0, 0, 0), "R": (0, 0, 2)}
H_ACTION = {"P": "aaa", "Q": "aaa", "R": "baa"}  # R's first action differs from P's


def hgpo_example(**kwargs) -> np.ndarray:
    return compute_hgpo_advantages(
        ["g"] * 9, [r[0] for r in H_ROWS], [H_ANCHOR[r[0]][int(r[1])] for r in H_ROWS],
        [float(H_REWARD[r[0]][int(r[1])]) for r in H_ROWS],
        actions=[H_ACTION[r[0]][int(r[1])] for r in H_ROWS], gamma=0.5, **kwargs)


def test_hgpo_mean_norm_hand_computed():
    # Level 1 (the state): x {P0 .25, R0 .5} -> -/+.125; y {P1 .5, Q1 0, R1 1} -> 0, -.5, +.5;
    #   z {P2 1, Q2 0} -> +/-.5; w, q alone.
    # Level 2 (previous state + state): (x,y) {P1 .5, R1 1} -> -/+.25; (y,z) {P2 1, Q2 0} -> +/-.5; (w,y), (y,q)
    #   alone. Level 3: every context is unique.
    # Weights (k + 1): 2, 3, 4 over the levels with a non-zero score: R1 = (2 * .5 + 3 * .25) / 5 = .35.
    expected = {"P0": -0.125, "P1": -0.25, "P2": 0.5, "Q0": 0.0, "Q1": -0.5, "Q2": -0.5, "R0": 0.125,
                "R1": 0.35, "R2": 0.0}
    adv = hgpo_example(history_length=2, alpha=1.0, mode="mean_norm")
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [expected[r] for r in H_ROWS], atol=1e-6)
    # alpha 0: plain mean over the scored levels
    np.testing.assert_allclose(hgpo_example(history_length=2, alpha=0.0, mode="mean_norm")[7], 0.375, atol=1e-6)
    # history_length 0 is GiGPO's step level alone
    np.testing.assert_allclose(hgpo_example(history_length=0, mode="mean_norm")[[1, 4, 7]], [0.0, -0.5, 0.5],
                               atol=1e-6)


def test_hgpo_mean_std_norm_actions_and_episode_level():
    # mean_std_norm uses the population std, as the reference code: y (.5, 0, 1) has std sqrt(1/6), (x,y) .25.
    sd = math.sqrt(1 / 6)
    adv = hgpo_example(history_length=1, mode="mean_std_norm")
    assert adv[7] == pytest.approx((2 * 0.5 / sd + 3 * 1.0) / 5, rel=1e-5)
    # with_actions: P1 and R1 came from x by different actions, so (x, y) splits into singletons
    with_actions = hgpo_example(history_length=2, mode="mean_norm", with_actions=True)
    assert with_actions[1] == pytest.approx(0.0) and with_actions[7] == pytest.approx(0.5, abs=1e-6)
    # base_group: the episode level (P 0, Q -1, R +1) joins with weight 1
    based = hgpo_example(history_length=2, mode="mean_norm", base_group=True)
    assert based[7] == pytest.approx((1 * 1.0 + 2 * 0.5 + 3 * 0.25) / 6, rel=1e-5)
    assert based[3] == pytest.approx(-1.0, rel=1e-5)  # Q0: only the episode level scores it
    with pytest.raises(ValueError, match="actions"):
        compute_hgpo_advantages(["g"], [0], ["x"], [1.0], with_actions=True)


def test_reinforce_pp_statistics_merge_over_blocks():
    """The same rows in one call or in three blocks (whole groups each), statistics merged: the same advantages."""
    ex = _no_anchor(example())
    whole = compute_reinforce_pp_advantages(**ex, baseline=True)
    g, t, r = (np.asarray(ex[k], dtype=object) for k in ("group_ids", "traj_ids", "step_rewards"))
    blocks = [np.flatnonzero(np.isin(g, part)) for part in (["g1"], ["g2"])]
    parts = [reinforce_pp_values(g[b], t[b], r[b].astype(float), baseline=True) for b in blocks]
    moments = Moments()
    for values, counted in parts:
        moments = moments.merge(Moments.of(values[counted]))
    merged = np.empty(len(ROWS), dtype=np.float32)
    for b, (values, _) in zip(blocks, parts, strict=True):
        merged[b] = whiten(values, moments)
    np.testing.assert_allclose(merged, whole, rtol=1e-6)
