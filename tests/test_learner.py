"""The training worker's batch maths (actors/learner.py) on the real default model, without Ray: left-padded
batches with logits for the reply positions only must give exactly what one unpadded forward per row gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.learner import collate, reply_values, sft_step, token_logprobs


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from app.default_model import resolve_model

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(resolve_model("default:tiny"), dtype=torch.float32).eval()


def _rows(rng: np.random.Generator, n: int, vocab: int):
    prompts = [rng.integers(3, vocab, size=rng.integers(1, 30)).tolist() for _ in range(n)]
    replies = [rng.integers(3, vocab, size=rng.integers(0, 6)).tolist() for _ in range(n)]
    replies[0] = rng.integers(3, vocab, size=5).tolist()  # at least one reply of the full width
    return prompts, replies


def _reference_logprobs(model, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """Log-probs of the reply tokens from one unpadded forward of that row alone."""
    ids = torch.tensor([prompt + reply])
    logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(prompt) - 1:]


def test_collate_lays_out_rows_and_values():
    batch = collate([[5, 6, 7], [8]], [[9, 10], [11]], pad_id=0, values={"extra": [[-0.5, -1.5], [-2.0]]})
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 10], [0, 0, 0, 8, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]
    assert batch["response_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["extra"].tolist() == [[-0.5, -1.5], [0.0, -2.0]]
    assert [v.tolist() for v in reply_values(batch["extra"], batch["response_mask"])] == [[-0.5, -1.5], [-2.0]]


def test_padded_reply_logprobs_match_one_row_at_a_time(model):
    rng = np.random.default_rng(0)
    prompts, replies = _rows(rng, 12, model.config.vocab_size)
    batch = collate(prompts, replies, pad_id=0)
    with torch.no_grad():
        logp, entropy = token_logprobs(model, batch, with_entropy=True)
        got = reply_values(logp, batch["response_mask"])
        for p, r, g in zip(prompts, replies, got, strict=True):
            torch.testing.assert_close(torch.from_numpy(g), _reference_logprobs(model, p, r), atol=1e-5, rtol=1e-5)
    assert logp.shape == (12, 5) and entropy.shape == (12, 5)
    assert torch.isfinite(entropy).all()


def test_padded_gradients_are_finite_and_match_unpadded(model):
    """Padding must neither change the gradient nor leak NaNs from fully masked pad positions."""
    rng = np.random.default_rng(1)
    prompts, replies = _rows(rng, 6, model.config.vocab_size)
    replies = [r or [4] for r in replies]
    model.zero_grad()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sft_step(model, optimizer, prompts, replies, range(len(prompts)), lr=0.0, micro_batch_size=4, grad_clip=1e9,
             pad_id=0, device="cpu", optimizer_steps=False)
    padded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the same loss (mean over all reply tokens) from unpadded rows
    n_tokens = sum(len(r) for r in replies)
    loss = -sum(_reference_logprobs(model, p, r).sum() for p, r in zip(prompts, replies, strict=True)) / n_tokens
    loss.backward()
    for g_padded, p in zip(padded, model.parameters(), strict=True):
        assert torch.isfinite(g_padded).all()
        torch.testing.assert_close(g_padded, p.grad, atol=1e-5, rtol=1e-4)
    model.zero_grad()
