"""Policy loss, aggregation modes, KL estimators and entropy on small hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms.losses import (
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
)


def _single_token(ratio: float, advantage: float, **kwargs):
    """Loss and d loss / d logprob for one token with the given ratio."""
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = policy_loss(
        logprobs, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1), **kwargs
    )
    loss.backward()
    return loss.item(), logprobs.grad.item(), metrics


@pytest.mark.parametrize(
    "ratio, advantage, expected_loss, has_grad, clipped_side",
    [
        (1.1, 1.0, -1.1, True, None),  # inside the range: plain -A r
        (1.5, 1.0, -1.28, False, "high"),  # A > 0, ratio above 1 + 0.28: clipped, no gradient
        (1.5, -1.0, 1.5, True, None),  # A < 0, ratio high: the unclipped (worse) term wins, gradient kept
        (0.5, -1.0, 0.8, False, "low"),  # A < 0, ratio below 1 - 0.2: clipped, no gradient
        (0.5, 1.0, -0.5, True, None),  # A > 0, ratio low: unclipped term, gradient kept
    ],
)
def test_clip_both_sides(ratio, advantage, expected_loss, has_grad, clipped_side):
    loss, grad, metrics = _single_token(ratio, advantage, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(expected_loss, rel=1e-9)
    if has_grad:
        assert grad == pytest.approx(-advantage * ratio, rel=1e-9)  # d(-A exp(logp)) / d logp
    else:
        assert grad == 0.0
    assert metrics["clip_frac"] == (1.0 if clipped_side else 0.0)
    assert metrics["clip_frac_high"] == (1.0 if clipped_side == "high" else 0.0)
    assert metrics["clip_frac_low"] == (1.0 if clipped_side == "low" else 0.0)


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0: clipped under symmetric PPO (0.2), free under DAPO's clip_high 0.28.
    loss, _, _ = _single_token(1.25, 1.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2)
    loss, _, _ = _single_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(-1.25)


def test_clip_fraction_and_approx_kl_over_mask():
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 9.0], [1.0, 0.5, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 9.0 ratio is padding and must not count
    _, metrics = policy_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)  # 1.5 with A > 0 and 0.5 with A < 0
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 5)
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert metrics["approx_kl"] == pytest.approx((k3(1.5) + k3(0.5)) / 5, rel=1e-5)


def test_gspo_sequence_ratio():
    # Token log-ratios (0.1, 0.3) and a padded token: sequence ratio exp(mean) = exp(0.2) for both real tokens.
    logprobs = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        mask,
        clip_low=0.5,
        clip_high=0.5,
        loss_agg_mode="seq-mean-token-mean",
        ratio_mode="sequence",
    )
    assert loss.item() == pytest.approx(-math.exp(0.2), rel=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(math.exp(0.2), rel=1e-6)
    loss.backward()
    # d(-s)/d logp_t = -s / |y| for each real token, 0 for padding.
    expected = [-math.exp(0.2) / 2, -math.exp(0.2) / 2, 0.0]
    assert logprobs.grad[0].tolist() == pytest.approx(expected, rel=1e-6)
    # Clipping acts on the sequence ratio: exp(0.2) = 1.22 > 1 + 0.1, so clipped for both tokens.
    _, metrics = policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, clip_low=0.1, clip_high=0.1, ratio_mode="sequence"
    )
    assert metrics["clip_frac"] == 1.0


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last response is empty: left out of every count
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(loss, mask, "sum")
    # The mode reaches the policy loss: ratio 1 everywhere -> loss = -aggregate(A).
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        pl, _ = policy_loss(torch.zeros(3, 3), torch.zeros(3, 3), adv, mask, loss_agg_mode=mode)
        assert pl.item() == pytest.approx(-aggregate_loss(adv, mask, mode).item())


def test_kl_estimators_on_known_example():
    # pi(y) = 0.5, pi_ref(y) = 0.25: x = ln 2.
    lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    x = math.log(2)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(x)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * x * x)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + x)  # exp(-x) - 1 + x
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + x)
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(lp, ref, "k4")


def test_kl_estimators_are_unbiased_and_k3_nonnegative():
    # Expectation under pi over a whole categorical distribution equals the true KL(pi || ref) for k1 and k3.
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    true_kl = (pi * (pi / ref).log()).sum()
    for kind in ("k1", "k3"):
        assert (pi * kl_penalty(pi.log(), ref.log(), kind)).sum().item() == pytest.approx(true_kl.item())
    assert (kl_penalty(pi.log(), ref.log(), "k3") >= 0).all()
    # Clamped: a huge log-ratio stays finite.
    assert torch.isfinite(kl_penalty(torch.tensor([0.0]), torch.tensor([-1000.0]), "k3")).all()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    value = kl_loss(pi.log()[None], ref.log()[None], mask, kind="k1")
    assert value.item() == pytest.approx(((pi / ref).log()[:2].sum() / 2).item())


def test_entropy_of_uniform_is_log_vocab():
    vocab = 37
    ent = entropy_from_logits(torch.zeros(2, 3, vocab))
    assert ent.shape == (2, 3)
    assert torch.allclose(ent, torch.full((2, 3), math.log(vocab)))
    # A one-hot-like distribution has ~0 entropy; the bonus is -coef * mean entropy and the value is reported.
    logits = torch.zeros(1, 2, vocab)
    logits[0, 1, 0] = 100.0
    bonus, value = entropy_bonus(logits, torch.ones(1, 2), coef=0.01)
    assert value.item() == pytest.approx(math.log(vocab) / 2, rel=1e-5)
    assert bonus.item() == pytest.approx(-0.01 * math.log(vocab) / 2, rel=1e-5)


def test_masked_mean_and_validation():
    x = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    m = torch.tensor([[1, 0], [1, 1]])
    assert masked_mean(x, m).item() == pytest.approx(13 / 3)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.0, 6.0])
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0
    with pytest.raises(ValueError, match="ratio_mode"):
        policy_loss(x, x, torch.ones(2), m, ratio_mode="seq")
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(x, x[:, :1], torch.ones(2), m)


def test_entropy_dtypes():
    logits = torch.randn(2, 4, 11)
    assert entropy_from_logits(logits.double()).dtype == torch.float64
    bf16 = entropy_from_logits(logits.bfloat16())
    assert bf16.dtype == torch.float32
    assert torch.allclose(bf16, entropy_from_logits(logits), atol=2e-2)
