"""What one training worker computes on a batch of step records: padding, token log-probs, the RL loss and the
supervised (warm-start) loss. Plain torch, no Ray: the Train worker loop and `raygent sft` both call these.

A step record is one (prompt, response) pair: `prompt_ids`, `response_ids`, and for RL also `rollout_logprobs`
(per response token, from the engine) and `advantage` (one per row, from the estimator).

Agent prompts are long and replies short (Sokoban: ~130 prompt tokens, 9 reply tokens), so only the reply
positions get logits: rows are left-padded so that every reply ends in the last column, and the model is asked for
the logits of the last R+1 positions only (R = the longest reply). The [B, T, vocab] logits of the whole sequence,
their log-softmax and entropy were most of a CPU update's time and memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from algorithms.losses import entropy_from_logits, kl_loss, masked_mean, policy_loss


def collate(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int,
            extra: Sequence[Sequence[float]] | None = None) -> dict[str, torch.Tensor]:
    """Left-pad prompt+response rows so that every row ends in the last column; the replies then sit in the last
    R = (longest reply) columns. `response_mask` [B, R] marks each row's reply tokens (right-aligned), the grid of
    `token_logprobs`; `extra` (per reply token, e.g. rollout log-probs) is laid out on the same grid."""
    prompt_len = np.fromiter((len(p) for p in prompt_ids), dtype=np.int64, count=len(prompt_ids))
    reply_len = np.fromiter((len(r) for r in response_ids), dtype=np.int64, count=len(response_ids))
    if prompt_len.min(initial=1) < 1:
        raise ValueError("every row needs at least one prompt token")
    lengths = prompt_len + reply_len
    n_rows, width, reply_width = len(lengths), int(lengths.max()), max(1, int(reply_len.max()))
    # One scatter for the whole batch: token k of row b goes to column width - lengths[b] + k.
    tokens = np.concatenate([np.asarray(x, dtype=np.int64) for p, r in zip(prompt_ids, response_ids, strict=True)
                             for x in (p, r)])
    row = np.repeat(np.arange(n_rows), lengths)
    col = np.arange(len(tokens)) + np.repeat(width - np.cumsum(lengths), lengths)
    input_ids = np.full((n_rows, width), pad_id, dtype=np.int64)
    input_ids[row, col] = tokens
    attention = np.zeros((n_rows, width), dtype=np.int64)
    attention[row, col] = 1
    response_mask = np.arange(reply_width)[None, :] >= (reply_width - reply_len)[:, None]
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention),
             # left padding: positions count real tokens only, as in generation
             "position_ids": torch.from_numpy(np.maximum(attention.cumsum(axis=1) - 1, 0)),
             "response_mask": torch.from_numpy(response_mask.astype(np.float32))}
    if extra is not None:
        values = np.zeros((n_rows, reply_width), dtype=np.float32)
        values[response_mask] = np.concatenate([np.asarray(e, dtype=np.float32) for e in extra])
        batch["extra"] = torch.from_numpy(values)
    return batch


def reply_values(grid: torch.Tensor, response_mask: torch.Tensor) -> list[torch.Tensor]:
    """The per-row reply values of a [B, R] grid from `collate`/`token_logprobs`, as one 1-D tensor per row (to lay
    them out again in another batch)."""
    return list(torch.split(grid[response_mask.bool()], response_mask.sum(dim=1).long().tolist()))


def token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every reply-grid token [B, R] (and the entropy of each of those next-token distributions)."""
    reply_width = batch["response_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], logits_to_keep=reply_width + 1).logits[:, :-1].float()
    targets = batch["input_ids"][:, batch["input_ids"].shape[1] - reply_width:]
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
