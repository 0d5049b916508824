"""The training worker's forward + backward on real step records, as a ratio measured in one run:

logits of the reply positions only (`actors.learner`: left-padded rows, `logits_to_keep`) vs the straightforward
way (right-padded rows, logits, log-softmax and entropy at every position, then the reply positions picked out).
Agent prompts are long and replies short, so most of the full-sequence work is thrown away.

Rows: warm-start demonstrations of the training config (default: serve_configs/train.yaml, the embedded default),
one micro-batch, one thread, in this process (no Ray).
Usage (from the repo root):  python benchmarks/bench_learner.py [--config ...] [--rows 128] [--repeats 5]
Writes benchmarks/results/bench_learner.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from actors.demonstrations import make_demonstrations  # noqa: E402
from actors.learner import collate, token_logprobs  # noqa: E402
from algorithms.losses import entropy_from_logits, masked_mean  # noqa: E402
from app.default_model import resolve_model  # noqa: E402
from app.sft import build_config  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def full_sequence_loss(model: torch.nn.Module, prompts: list[list[int]], replies: list[list[int]]) -> torch.Tensor:
    """The baseline: right padding, logits at every position, the reply tokens' log-probs and entropy picked out."""
    rows = [p + r for p, r in zip(prompts, replies, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((len(rows), width - 1))
    for b, (p, r) in enumerate(zip(prompts, replies, strict=True)):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        attention[b, :len(p) + len(r)] = 1
        mask[b, len(p) - 1:len(p) + len(r) - 1] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -masked_mean(logp, mask) - 0.01 * masked_mean(entropy_from_logits(logits), mask)


def reply_only_loss(model: torch.nn.Module, prompts: list[list[int]], replies: list[list[int]]) -> torch.Tensor:
    batch = collate(prompts, replies, pad_id=0)
    logp, entropy = token_logprobs(model, batch, with_entropy=True)
    mask = batch["response_mask"]
    return -masked_mean(logp, mask) - 0.01 * masked_mean(entropy, mask)


def seconds_per_step(loss_fn, model, prompts, replies, repeats: int) -> list[float]:
    times = []
    for i in range(repeats + 1):  # the first one warms up
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss_fn(model, prompts, replies).backward()
        if i:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    cfg = build_config(str(args.config), None, {})
    path = resolve_model(cfg.policy.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    demos = make_demonstrations(tokenizer, cfg.env.name, cfg.env_kwargs, cfg.memory.name, cfg.memory.kwargs,
                                range(200), cfg.warm_start.expert_prob, cfg.seed)
    prompts, replies = demos["prompt_ids"][:args.rows], demos["response_ids"][:args.rows]
    # Interleaved, so that both see the same machine load.
    full, reply_only = [], []
    for _ in range(2):
        full += seconds_per_step(full_sequence_loss, model, prompts, replies, args.repeats)
        reply_only += seconds_per_step(reply_only_loss, model, prompts, replies, args.repeats)
    result = {
        "config": str(args.config), "model": cfg.policy.model, "rows": len(prompts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "reply_tokens_mean": sum(map(len, replies)) / len(replies), "vocab": model.config.vocab_size,
        "full_sequence_s": statistics.median(full), "reply_only_s": statistics.median(reply_only),
        "speedup": statistics.median(full) / statistics.median(reply_only), "runs": {"full": full, "reply": reply_only},
    }
    print(f"forward+backward of {len(prompts)} rows ({result['prompt_tokens_mean']:.0f} prompt + "
          f"{result['reply_tokens_mean']:.1f} reply tokens): full-sequence logits {result['full_sequence_s']:.3f} s, "
          f"reply-only logits {result['reply_only_s']:.3f} s -> {result['speedup']:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_learner.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote benchmarks/results/bench_learner.json")


if __name__ == "__main__":
    main()
