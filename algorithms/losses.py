"""Policy-gradient losses on token log-probabilities (torch).

Shapes: `logprobs`, `old_logprobs`, `ref_logprobs`, `mask` are [B, T] (B responses of up to T tokens, `mask` 1 on
response tokens, 0 on padding); `advantages` is [B] (one per response, broadcast to its tokens) or [B, T];
`logits` is [B, T, V].

- `policy_loss_terms` / `policy_loss`: PPO's clipped surrogate (Schulman et al., 2017, arXiv 1707.06347, Eq. 7) with separate lower and
  upper clip ranges (DAPO's "clip-higher", Yu et al., 2025, arXiv 2503.14476, Sec. 3.1), and GSPO's
  sequence-level ratio (Zheng et al., 2025, arXiv 2507.18071) as an option.
- `aggregate_loss` / `loss_denominator`: how per-token losses become one number (token-mean, seq-mean-token-sum,
  seq-mean-token-mean, seq-mean-token-sum-norm), the choice that DAPO and Dr. GRPO show to matter, over a whole
  minibatch however it is split into micro-batches and ranks.
- `kl_penalty` / `kl_loss`: per-token KL(pi || pi_ref) estimators k1, k2, k3 (Schulman, "Approximating KL
  divergence", 2020); k3 is the low-variance, always >= 0 one that GRPO and GiGPO use.
- `entropy_from_logits` / `entropy_bonus`.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_MODES = ("token", "sequence")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")

# PPO paper: epsilon = 0.2. DAPO raises only the upper bound (0.28) so low-probability tokens can grow, which keeps
# entropy from collapsing. (GSPO's sequence ratios need far smaller ranges, e.g. 3e-4 / 4e-4 in its paper.)
CLIP_LOW = 0.2
CLIP_HIGH = 0.28
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps exp finite when a policy moved a lot; only such outliers are touched


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (0 if there are none)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def loss_denominator(mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """What `loss_agg_mode` divides by, counted over the rows of `mask`: response tokens for "token-mean", responses
    with at least one token for every "seq-mean-*" mode. Sum it over every micro-batch and rank of a minibatch and
    hand the total to `aggregate_loss(denominator=...)`: the micro-batch losses then add up to the minibatch's loss
    exactly, however the minibatch is cut."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    mask = mask.detach().to(torch.float64)
    if loss_agg_mode == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum().to(torch.float64)


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    - "token-mean": sum over all response tokens / number of tokens; every token weighs the same (DAPO, Sec. 3.3).
    - "seq-mean-token-sum": each response's token sum, averaged over responses.
    - "seq-mean-token-mean": mean within each response, then over responses (original GRPO; GSPO's sequence loss);
      every response weighs the same, so long responses' tokens weigh less.
    - "seq-mean-token-sum-norm": each response's token sum divided by the constant `norm_length` (Dr. GRPO: the
      maximum response length of the run; default T, the width of this batch), averaged over responses: no
      length bias.
    Responses without any token are left out of the response count.

    `denominator`: the count of `loss_denominator` over the whole minibatch (all micro-batches and ranks); the
    result is then this batch's share of the minibatch loss. Default: this batch's own count.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    mask = mask.to(loss.dtype)
    if loss_agg_mode == "token-mean":
        numerator = (loss * mask).sum()
    else:
        seq_sum = (loss * mask).sum(-1)
        if loss_agg_mode == "seq-mean-token-sum":
            numerator = seq_sum.sum()
        elif loss_agg_mode == "seq-mean-token-mean":
            numerator = (seq_sum / mask.sum(-1).clamp(min=1)).sum()
        else:
            numerator = seq_sum.sum() / (loss.shape[-1] if norm_length is None else norm_length)
    if denominator is None:
        denominator = loss_denominator(mask, loss_agg_mode)
    denominator = torch.as_tensor(denominator, dtype=loss.dtype, device=loss.device)
    return numerator / denominator.clamp(min=1)


def policy_loss_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    ratio_mode: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate per token [B, T] (to minimize; aggregate it with `aggregate_loss`) and per-token
    statistics (no gradient, same shape; average them over the mask):

    ratio_mode "token": r_t = pi(y_t) / pi_old(y_t) per token (PPO / GRPO / DAPO).
    ratio_mode "sequence": s_i = (pi(y_i) / pi_old(y_i)) ^ (1/|y_i|) = exp(mean_t log r_t), one ratio for all tokens
    of response i (GSPO). With per-response advantages and "seq-mean-token-mean" this is exactly GSPO's objective;
    gradients flow through the mean log-ratio.

    Per token: loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)), the pessimistic bound.
    Statistics: `clip_frac` (the clipped branch is active, i.e. the token gets no gradient), split into
    `clip_frac_low` (A < 0, ratio below 1 - clip_low) and `clip_frac_high` (A > 0, ratio above 1 + clip_high);
    `approx_kl` (k3 estimate of KL(pi_old || pi) from the token ratios, as CleanRL logs it); `ratio_mean`.
    """
    if ratio_mode not in RATIO_MODES:
        raise ValueError(f"unknown ratio_mode {ratio_mode!r}; expected one of {RATIO_MODES}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must have one shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # one advantage per response -> every token of it
    advantages = advantages.to(logprobs.dtype)

    token_log_ratio = logprobs - old_logprobs.detach()
    if ratio_mode == "sequence":
        log_ratio = masked_mean(token_log_ratio, mask, dim=-1)[:, None].expand_as(token_log_ratio)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)

    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (advantages < 0)
        high = (ratio > 1.0 + clip_high) & (advantages > 0)
        token_ratio = torch.exp(token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        stats = {
            "clip_frac": (low | high).to(logprobs.dtype),
            "clip_frac_low": low.to(logprobs.dtype),
            "clip_frac_high": high.to(logprobs.dtype),
            "approx_kl": token_ratio - 1.0 - token_log_ratio,
            "ratio_mean": ratio.detach(),
        }
    return loss, stats


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    loss_agg_mode: str = "token-mean",
    ratio_mode: str = "token",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss_terms` aggregated over this one batch: the loss (to minimize) and the token means of its
    statistics. The training step (`actors.learner`) aggregates over a whole minibatch instead."""
    loss, stats = policy_loss_terms(logprobs, old_logprobs, advantages, mask, clip_low=clip_low,
                                    clip_high=clip_high, ratio_mode=ratio_mode)
    metrics = {k: masked_mean(v, mask).item() for k, v in stats.items()}
    return aggregate_loss(loss, mask, loss_agg_mode, norm_length=norm_length), metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (log-probs of the sampled tokens).

    With x = log pi(y) - log pi_ref(y):  k1 = x (unbiased, can be negative),  k2 = x^2 / 2,
    k3 = exp(-x) - 1 + x (unbiased, >= 0, low variance; "low_var_kl", clamped to [-10, 10] as in verl).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # exp(-x) must stay finite
    return (torch.exp(-log_ratio) - 1.0 + log_ratio).clamp(-10.0, 10.0)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """KL(pi || pi_ref) penalty as a loss term (multiply by its coefficient, e.g. 0.01 in GiGPO, and add)."""
    return aggregate_loss(kl_penalty(logprobs, ref_logprobs, kind), mask, loss_agg_mode)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution over the last dimension: -sum_v p_v log p_v."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # bf16 / fp16 log-softmax over a large vocabulary is too coarse
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def entropy_bonus(
    logits: torch.Tensor, mask: torch.Tensor, *, coef: float, loss_agg_mode: str = "token-mean"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-coef * mean entropy, mean entropy): add the first to the loss to reward exploration; log the second."""
    entropy = aggregate_loss(entropy_from_logits(logits), mask, loss_agg_mode)
    return -coef * entropy, entropy.detach()
