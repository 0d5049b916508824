"""The update: what the training ranks compute on a batch of step records. Plain torch, no Ray: the Train worker loop
(`actors/trainer.py`), `raygent sft` and the tests call `rl_step` and `sft_step`, so the loss you read here is the
loss that runs.

A step record is one (prompt, response) pair: `prompt_ids`, `response_ids`, and for RL also `rollout_logprobs`
(per response token, from the engine) and `advantage` (one per row, from the estimator). A conversation row
(`actors/conversation.py`) also has `loss_mask` (1 on the model's tokens, 0 on the env's and tools' tokens between
its turns) and `token_advantages` (each turn's advantage on its tokens): every term of the loss, its denominators
and every statistic (log-prob gap, importance weights, clip fractions) count the model's tokens only.

Exact aggregation. A minibatch (the rows of one optimizer step) is spread over the ranks and, on each rank, over
micro-batches. Before any backward, the ranks sum what the loss divides by (`algorithms.losses.loss_denominator`:
tokens for token-mean, responses for the seq-mean modes) over the whole minibatch; each micro-batch's loss is its
numerator over that global count, times the world size because FSDP / DDP average the ranks' gradients. The gradient
is then that of the configured loss over the whole minibatch, whatever `micro_batch_size` and `num_workers` are.
Ranks that hold fewer rows run zero-weight micro-batches, so every rank takes part in every collective.

Agent prompts are long and replies short (Sokoban: ~130 prompt tokens, 9 reply tokens), so only the reply
positions get logits: rows are left-padded so that every reply ends in the last column, and the model is asked for
the logits of the last R+1 positions only (R = the longest reply).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from actors.config import OptimConfig
from algorithms.losses import aggregate_loss, entropy_from_logits, kl_penalty, policy_loss_terms


# ---- talking to the other ranks ---------------------------------------------------------------------------------
class Collective:
    """Sums and maxima across the ranks of one update (torch.distributed); a process alone is a world of one."""

    def __init__(self, world: int = 1):
        self.world = world
        self.on_progress: Callable[[], None] | None = None  # told after every reduction (a step forward)

    @classmethod
    def from_torch(cls) -> Collective:
        import torch.distributed as dist

        return cls(dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)

    def _reduce(self, values: Sequence[float], op: str, dtype: torch.dtype) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(list(values), dtype=dtype, device=device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        if self.on_progress is not None:
            self.on_progress()
        return t.cpu().tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, "SUM", torch.float64)

    def max(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in self._reduce(values, "MAX", torch.int64)]


ALONE = Collective()


# ---- batches ----------------------------------------------------------------------------------------------------
def collate(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int,
            values: dict[str, Sequence[Sequence[float]]] | None = None) -> dict[str, torch.Tensor]:
    """Left-pad prompt+response rows so that every row ends in the last column; the replies then sit in the last
    R = (longest reply) columns. `response_mask` [B, R] marks each row's reply tokens (right-aligned), the grid of
    `token_logprobs`; each of `values` (per reply token, e.g. rollout log-probs) is laid out on the same grid."""
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
    for name, per_row in (values or {}).items():
        grid = np.zeros((n_rows, reply_width), dtype=np.float32)
        grid[response_mask] = np.concatenate([np.asarray(v, dtype=np.float32) for v in per_row])
        batch[name] = torch.from_numpy(grid)
    return batch


def reply_values(grid: torch.Tensor, response_mask: torch.Tensor) -> list[np.ndarray]:
    """The per-row reply values of a [B, R] grid from `collate`/`token_logprobs`, one 1-D array per row (to lay them
    out again in another batch)."""
    flat = grid.detach().float().cpu()[response_mask.bool().cpu()].numpy()
    return np.split(flat, np.cumsum(response_mask.sum(dim=1).long().cpu().numpy())[:-1])


def token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every reply-grid token [B, R] (and the entropy of each of those next-token distributions, with a
    gradient only when `entropy_grad`: as a metric it costs no autograd graph)."""
    reply_width = batch["response_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], logits_to_keep=reply_width + 1).logits[:, :-1].float()
    targets = batch["input_ids"][:, batch["input_ids"].shape[1] - reply_width:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logp, entropy


def _plan(n_local: int, size: int, collective: Collective) -> list[np.ndarray | None]:
    """Micro-batches of this rank's `n_local` rows, padded with None (a zero-weight micro-batch) up to the largest
    count of any rank: every rank then runs the same number of forward/backward passes (FSDP's collectives)."""
    parts = [np.arange(i, min(i + size, n_local)) for i in range(0, n_local, size)]
    (most,) = collective.max([len(parts)])
    return parts + [None] * (most - len(parts))


def _dummy_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """One row of one prompt and one reply token: a rank with no rows left still runs the forward and backward
    (contributing zero) so that no other rank waits in a collective."""
    return collate([[pad_id]], [[pad_id]], pad_id)


def _to(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def autocast(device: torch.device | str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """bf16 compute for a model that is not under FSDP2's MixedPrecisionPolicy (float32 master weights stay)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the global gradient norm (all shards), step, clear; the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def lr_at(optim: OptimConfig, iteration: int, iterations: int) -> float:
    """The RL learning rate of `iteration` (0-based) of a run of `iterations`: linear warmup over
    `lr_warmup_iterations`, then constant, linear or cosine decay to `lr * lr_min_ratio` at the last iteration.
    A function of the iteration alone, so a resumed run continues the schedule exactly."""
    if iteration < optim.lr_warmup_iterations:
        return optim.lr * (iteration + 1) / optim.lr_warmup_iterations
    if optim.lr_schedule == "constant":
        return optim.lr
    span = max(1, iterations - 1 - optim.lr_warmup_iterations)
    progress = min(1.0, (iteration - optim.lr_warmup_iterations) / span)
    shape = 1.0 - progress if optim.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.lr * (optim.lr_min_ratio + (1.0 - optim.lr_min_ratio) * shape)


# ---- the RL step ------------------------------------------------------------------------------------------------
_TOKEN_STATS = ("approx_kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "kl")


def fresh_rows(rows: dict[str, list], version: int, max_staleness: int) -> tuple[dict[str, list], np.ndarray]:
    """The rows that may enter the loss: those sampled by weight versions `version - max_staleness` .. `version`
    (the trainer holds `version`). Returns them and a histogram of every row's staleness (version - its
    weight_version): bins 0..max_staleness, then one bin for the rows left out (older, or from a version the
    trainer never had)."""
    staleness = version - np.asarray(rows.get("weight_version", []), dtype=np.int64)
    fresh = (staleness >= 0) & (staleness <= max_staleness)
    hist = np.bincount(staleness[fresh], minlength=max_staleness + 1).astype(np.float64)
    hist = np.append(hist, float(np.count_nonzero(~fresh)))
    if fresh.all():
        return rows, hist
    keep = np.flatnonzero(fresh)
    return {k: [v[i] for i in keep] for k, v in rows.items()}, hist


def behaviour_logprobs(model: torch.nn.Module, rows: dict[str, list], optim: OptimConfig, *, pad_id: int,
                       device: torch.device | str, collective: Collective = ALONE,
                       autocast_dtype: torch.dtype | None = None) -> list[np.ndarray]:
    """The trainer's own log-probs of every reply token under the current weights (before any update)."""
    out: list[np.ndarray] = []
    with torch.no_grad(), autocast(device, autocast_dtype):
        for idx in _plan(len(rows["prompt_ids"]), optim.micro_batch_size, collective):
            if idx is None:
                token_logprobs(model, _to(_dummy_batch(pad_id), device))
                continue
            batch = collate([rows["prompt_ids"][i] for i in idx], [rows["response_ids"][i] for i in idx], pad_id)
            logp, _ = token_logprobs(model, _to(batch, device))
            out += reply_values(logp, batch["response_mask"])
    return out


def importance_weights(trainer_logprobs: Sequence[np.ndarray], rollout_logprobs: Sequence[Sequence[float]]
                       ) -> list[np.ndarray]:
    """Per reply token, w = exp(trainer's - engine's behaviour log-prob): how much more likely the trainer's weights
    make the token than the engine that sampled it did (1 when they agree)."""
    return [np.exp(np.clip(np.asarray(t, np.float64) - np.asarray(r, np.float64), -20.0, 20.0))
            for t, r in zip(trainer_logprobs, rollout_logprobs, strict=True)]


def correction_weights(raw: Sequence[np.ndarray], optim: OptimConfig) -> list[np.ndarray]:
    """What `rollout_correction` does with each token's loss, from its importance weight w: "tis" multiplies it by
    min(w, cap) (truncated importance sampling), "mask" keeps (1) or drops (0) the token by whether w lies in
    [floor, cap] ("icepop"-style); "none" leaves it (1)."""
    if optim.rollout_correction == "tis":
        return [np.minimum(w, optim.rollout_is_cap).astype(np.float32) for w in raw]
    if optim.rollout_correction == "mask":
        return [((w >= optim.rollout_is_floor) & (w <= optim.rollout_is_cap)).astype(np.float32) for w in raw]
    return [np.ones(len(w), np.float32) for w in raw]


def _denominator(weights: Sequence[np.ndarray], keep: Sequence[np.ndarray], rows: np.ndarray,
                 optim: OptimConfig) -> float:
    """This rank's share of the minibatch's `loss_denominator`, from the rows' token masks (before any forward)."""
    if optim.rollout_correction == "mask":
        kept = [float(np.count_nonzero(weights[i] * keep[i])) for i in rows]
    else:
        kept = [float(keep[i].sum()) for i in rows]
    if optim.loss_agg_mode == "token-mean":
        return float(sum(kept))
    return float(sum(k > 0 for k in kept))


def rl_loss(logp: torch.Tensor, entropy: torch.Tensor, ref: torch.Tensor | None, batch: dict[str, torch.Tensor],
            mask: torch.Tensor, optim: OptimConfig, norm_length: int, denominator: float
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of its minibatch's loss (and its policy-gradient part, and per-token statistics):

        loss = pg - entropy_coef * H + kl_coef * KL(pi || pi_ref),  every term aggregated by loss_agg_mode over the
                                                                     minibatch's `denominator` (all micro-batches
                                                                     and ranks)
    where pg's per-token terms are the clipped surrogate, times min(w, cap) under "tis"."""
    pg_tokens, stats = policy_loss_terms(logp, batch["old_logprobs"], batch["advantages"], mask,
                                         clip_low=optim.clip_low, clip_high=optim.clip_high,
                                         ratio_mode=optim.ratio_mode)
    if optim.rollout_correction == "tis":
        pg_tokens = pg_tokens * batch["weight"]

    def aggregate(tokens: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(tokens, mask, optim.loss_agg_mode, norm_length=norm_length, denominator=denominator)

    pg = aggregate(pg_tokens)
    loss = pg
    if optim.entropy_coef > 0:
        loss = loss - optim.entropy_coef * aggregate(entropy)
    if ref is not None:
        kl_tokens = kl_penalty(logp, ref, optim.kl_estimator)
        loss = loss + optim.kl_coef * aggregate(kl_tokens)
        stats["kl"] = kl_tokens.detach()
    return loss, pg, stats


def rl_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: dict[str, list], optim: OptimConfig, *,
            lr: float, norm_length: int, pad_id: int, device: torch.device | str, rng: np.random.Generator,
            collective: Collective = ALONE, ref_model: torch.nn.Module | None = None,
            autocast_dtype: torch.dtype | None = None, optimizer_steps: bool = True) -> dict[str, float]:
    """One RL update on this rank's `rows` (its share of the iteration's batch): `optim.epochs` passes, each cut into
    ceil(global rows / minibatch_size) optimizer steps, the loss of each step exactly as `optim` configures it over
    that step's rows on every rank:

        loss = pg + kl_coef * KL(pi || pi_ref) - entropy_coef * H,  each term aggregated by loss_agg_mode

    pg is the clipped surrogate (`algorithms.losses.policy_loss_terms`) of the behaviour log-probs (recomputed or
    the engine's, `old_logprobs`), with per-token weights from `rollout_correction`. Returns global metrics:
    token-weighted means of approx_kl, clip fractions, ratio, entropy and KL; the mean step loss; grad norm.
    `optimizer_steps=False` leaves the accumulated gradient of the (single) minibatch in place (tests)."""
    n_local = len(rows["prompt_ids"])
    rollout_old = [np.asarray(r, np.float32) for r in rows["rollout_logprobs"]]
    # the tokens that are the model's (all of a step row's reply) and each token's advantage
    keep = ([np.asarray(m, np.float32) for m in rows["loss_mask"]] if "loss_mask" in rows
            else [np.ones(len(r), np.float32) for r in rollout_old])
    advantages = ([np.asarray(a, np.float32) for a in rows["token_advantages"]] if "token_advantages" in rows
                  else [np.full(len(r), a, np.float32) for r, a in zip(rollout_old, rows["advantage"], strict=True)])
    set_lr(optimizer, lr)

    # 1. Behaviour log-probs: the trainer's own (then the first ratio is exactly 1, and the engine's differ only by
    #    numerics, measured as the gap and corrected as configured), or the engine's.
    if optim.old_logprobs == "recompute":
        old = behaviour_logprobs(model, rows, optim, pad_id=pad_id, device=device, collective=collective,
                                 autocast_dtype=autocast_dtype)
        gap_sum = sum(float((np.abs(o - r) * k).sum()) for o, r, k in zip(old, rollout_old, keep, strict=True))
        gap_tokens = float(sum(k.sum() for k in keep))
    else:
        old, gap_sum, gap_tokens = rollout_old, 0.0, 0.0  # the gap is measured on the first step below
    raw_weights = importance_weights(old, rollout_old)
    weights = correction_weights(raw_weights, optim)
    raw_weights = [w[k > 0] for w, k in zip(raw_weights, keep, strict=True)]  # its statistics: the model's tokens

    # 2. Optimizer steps over minibatches; each minibatch's denominators summed over all ranks first.
    (n_global,) = collective.sum([n_local])
    steps_per_epoch = max(1, math.ceil(n_global / optim.minibatch_size))
    sums = dict.fromkeys(_TOKEN_STATS, 0.0)
    sums.update(tokens=0.0, pg_loss=0.0, loss=0.0)
    norms: list[float] = []
    first_step = True
    for _ in range(optim.epochs):
        for minibatch in np.array_split(rng.permutation(n_local), steps_per_epoch):
            (denominator,) = collective.sum([_denominator(weights, keep, minibatch, optim)])
            for part in _plan(len(minibatch), optim.micro_batch_size, collective):
                if part is None:
                    batch, live = _to(_dummy_batch(pad_id), device), False
                else:
                    idx = minibatch[part]
                    batch = _to(collate([rows["prompt_ids"][i] for i in idx], [rows["response_ids"][i] for i in idx],
                                        pad_id, values={"old_logprobs": [old[i] for i in idx],
                                                        "rollout_logprobs": [rollout_old[i] for i in idx],
                                                        "weight": [weights[i] for i in idx],
                                                        "keep": [keep[i] for i in idx],
                                                        "advantages": [advantages[i] for i in idx]}), device)
                    live = True
                with autocast(device, autocast_dtype):
                    ref = None
                    if ref_model is not None:
                        with torch.no_grad():
                            ref, _ = token_logprobs(ref_model, batch)
                    logp, entropy = token_logprobs(model, batch, with_entropy=True,
                                                   entropy_grad=optim.entropy_coef > 0)
                if not live:  # zero-weight: only here so that every rank runs the same collectives
                    (logp.sum() * 0.0).backward()
                    continue
                mask = batch["keep"] * (batch["weight"] if optim.rollout_correction == "mask" else 1.0)
                loss, pg, stats = rl_loss(logp, entropy, ref, batch, mask, optim, norm_length, denominator)
                # FSDP and DDP average the ranks' gradients; the loss is a sum of the ranks' shares: undo the mean.
                (loss * collective.world).backward()

                with torch.no_grad():
                    stats["entropy"] = entropy.detach()
                    for name, value in stats.items():
                        sums[name] += float((value * mask).sum())
                    sums["tokens"] += float(mask.sum())
                    sums["pg_loss"] += float(pg.detach())
                    sums["loss"] += float(loss.detach())
                    if first_step and optim.old_logprobs == "rollout":
                        real = batch["keep"]
                        gap_sum += float(((logp.detach() - batch["rollout_logprobs"]).abs() * real).sum())
                        gap_tokens += float(real.sum())
            first_step = False
            if optimizer_steps:
                norms.append(optimizer_step(model, optimizer, optim.grad_clip))

    # 3. Global metrics: token-weighted over every token of every rank; step losses summed over ranks.
    keys = [*_TOKEN_STATS, "tokens", "pg_loss", "loss"]
    totals = dict(zip(keys, collective.sum([sums[k] for k in keys]), strict=True))
    gap_sum, gap_tokens = collective.sum([gap_sum, gap_tokens])
    is_stats = collective.sum([
        float(sum(w.sum() for w in raw_weights)), float(sum(len(w) for w in raw_weights)),
        float(sum(np.count_nonzero(w > optim.rollout_is_cap) for w in raw_weights)),
        float(sum(np.count_nonzero((w < optim.rollout_is_floor) | (w > optim.rollout_is_cap)) for w in raw_weights))])
    n_steps = steps_per_epoch * optim.epochs
    out = {k: totals[k] / max(totals["tokens"], 1.0) for k in _TOKEN_STATS}
    if ref_model is None:
        del out["kl"]
    out.update(pg_loss=totals["pg_loss"] / n_steps, loss=totals["loss"] / n_steps, lr=lr,
               grad_norm=float(np.mean(norms)) if norms else 0.0, optimizer_steps=len(norms), rows=n_global,
               tokens=totals["tokens"] / optim.epochs,
               rollout_trainer_logprob_gap=gap_sum / max(gap_tokens, 1.0))
    if optim.old_logprobs == "recompute":  # the mismatch the correction acts on, logged whether it is on or not
        out.update(rollout_is_weight_mean=is_stats[0] / max(is_stats[1], 1.0),
                   rollout_is_capped_frac=is_stats[2] / max(is_stats[1], 1.0),
                   rollout_is_outside_frac=is_stats[3] / max(is_stats[1], 1.0))
    return out


# ---- the supervised step ----------------------------------------------------------------------------------------
def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prompt_ids: Sequence[Sequence[int]],
             response_ids: Sequence[Sequence[int]], rows: Sequence[int], *, lr: float, micro_batch_size: int,
             grad_clip: float, pad_id: int, device: torch.device | str, collective: Collective = ALONE,
             autocast_dtype: torch.dtype | None = None, optimizer_steps: bool = True,
             loss_masks: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """One supervised step: cross-entropy on the reply tokens only (the prompt is context, not a target), the mean
    over every reply token of `rows` on every rank, micro-batched. With `loss_masks` (conversation rows) only the
    tokens masked 1 are targets. Returns the step's global loss and grad norm."""
    set_lr(optimizer, lr)
    rows = np.asarray(rows, dtype=np.int64)
    keep = {int(i): np.asarray(loss_masks[i], np.float32) if loss_masks is not None
            else np.ones(len(response_ids[i]), np.float32) for i in rows}  # this step's rows only
    (n_tokens,) = collective.sum([float(sum(k.sum() for k in keep.values()))])
    loss_sum = 0.0
    for part in _plan(len(rows), micro_batch_size, collective):
        if part is None:
            with autocast(device, autocast_dtype):
                logp, _ = token_logprobs(model, _to(_dummy_batch(pad_id), device))
            (logp.sum() * 0.0).backward()
            continue
        idx = rows[part]
        batch = _to(collate([prompt_ids[i] for i in idx], [response_ids[i] for i in idx], pad_id,
                            values={"keep": [keep[int(i)] for i in idx]}), device)
        with autocast(device, autocast_dtype):
            logp, _ = token_logprobs(model, batch)
        loss = -aggregate_loss(logp, batch["keep"], "token-mean", denominator=n_tokens)
        (loss * collective.world).backward()
        loss_sum += float(loss.detach())
    (loss_sum,) = collective.sum([loss_sum])
    norm = optimizer_step(model, optimizer, grad_clip) if optimizer_steps else 0.0
    return {"sft_loss": loss_sum, "grad_norm": norm}

