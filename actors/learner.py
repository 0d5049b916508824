"""What one training worker computes on a batch of step records: padding, token log-probs, the RL loss and the
supervised (warm-start) loss. Plain torch, no Ray: the Train worker loop and `raygent sft` both call these.

A step record is one (prompt, response) pair: `prompt_ids`, `response_ids`, and for RL also `rollout_logprobs`
(per response token, from the engine) and `advantage` (one per row, from the estimator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from algorithms.losses import entropy_from_logits, kl_loss, masked_mean, policy_loss


def collate(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int,
            extra: Sequence[Sequence[float]] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response sequences. `response_mask[b, j]` is 1 where token j+1 is a response token, so it
    lines up with `token_logprobs` (the log-prob of token j+1 from the logits at j). `extra` (per response token,
    e.g. rollout log-probs) is laid out on the same grid."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(lengths), width), dtype=torch.long)
    response_mask = torch.zeros((len(lengths), width - 1), dtype=torch.float32)
    aligned = torch.zeros((len(lengths), width - 1), dtype=torch.float32) if extra is not None else None
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):  # ragged rows: one copy each
        n_p, n = len(p), len(p) + len(r)
        input_ids[b, :n_p] = torch.as_tensor(np.asarray(p, dtype=np.int64))
        input_ids[b, n_p:n] = torch.as_tensor(np.asarray(r, dtype=np.int64))
        attention[b, :n] = 1
        response_mask[b, n_p - 1:n - 1] = 1.0
        if aligned is not None:
            aligned[b, n_p - 1:n - 1] = torch.as_tensor(np.asarray(extra[b], dtype=np.float32))
    batch = {"input_ids": input_ids, "attention_mask": attention, "response_mask": response_mask}
    if aligned is not None:
        batch["extra"] = aligned
    return batch


def token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every next token [B, T-1] (and the entropy of each next-token distribution)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, (entropy_from_logits(logits) if with_entropy else None)


def rl_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], optim: Any,
            ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate on the response tokens (+ KL to the reference, - entropy bonus), as configured in
    `optim` (an OptimConfig). `batch` carries `old_logprobs` [B, T-1] and `advantages` [B]."""
    mask = batch["response_mask"]
    logp, entropy = token_logprobs(model, batch, with_entropy=True)
    loss, metrics = policy_loss(logp, batch["old_logprobs"], batch["advantages"], mask,
                                clip_low=optim.clip_low, clip_high=optim.clip_high,
                                loss_agg_mode=optim.loss_agg_mode, ratio_mode=optim.ratio_mode)
    metrics["pg_loss"] = loss.item()
    mean_entropy = masked_mean(entropy, mask)
    metrics["entropy"] = mean_entropy.item()
    if optim.entropy_coef > 0:
        loss = loss - optim.entropy_coef * mean_entropy
    if ref_logprobs is not None:
        kl = kl_loss(logp, ref_logprobs, mask, kind=optim.kl_estimator, loss_agg_mode=optim.loss_agg_mode)
        metrics["kl"] = kl.item()
        loss = loss + optim.kl_coef * kl
    metrics["loss"] = loss.item()
    return loss, metrics


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the response tokens only (the prompt is context, not a target)."""
    logp, _ = token_logprobs(model, batch)
    loss = -masked_mean(logp, batch["response_mask"])
    return loss, {"sft_loss": loss.item()}


def sft_backward(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 rows: Sequence[int], pad_id: int, micro_batch_size: int, device: torch.device | str = "cpu"
                 ) -> list[dict[str, float]]:
    """Accumulate one supervised step's gradients over `rows`, micro-batched; each micro-batch's loss is weighted by
    its share of the rows, so the gradient is that of one batch. The caller clips and steps (the Train worker loop
    and `raygent sft` do this the same way). Returns each micro-batch's metrics."""
    metrics = []
    for sl in micro_batches(len(rows), micro_batch_size):
        sub = rows[sl]
        batch = collate([prompt_ids[i] for i in sub], [response_ids[i] for i in sub], pad_id)
        loss, m = sft_loss(model, {k: v.to(device) for k, v in batch.items()})
        (loss * (len(sub) / len(rows))).backward()
        metrics.append(m)
    return metrics


def micro_batches(n_rows: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def mean_metrics(metrics: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for m in metrics for k in m}
    return {k: float(np.mean([m[k] for m in metrics if k in m])) for k in sorted(keys)}
