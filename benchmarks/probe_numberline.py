"""What a number-line policy has learnt, without sampling noise: for every state (target, current) of the line, the
model's probability of the expert's move against the other one, as whole replies (`<action>+</action>` and EOS, the
warm start's label). Held-out success over 32-64 sampled episodes moves by +-0.06-0.09 from noise alone; this reads
the decision itself, all 72 states of `max_position` 8 at once.

Usage (from the repo root):  python benchmarks/probe_numberline.py MODEL_DIR [MODEL_DIR ...] [--max-position 8]
MODEL_DIR: an HF folder, e.g. a run's reference/ (the policy after the warm start) or checkpoints/iter_N/model.
Prints one JSON line per folder: decision accuracy (the expert's move the likelier), the mean probability of the
expert's move between the two, and the share of states where the model prefers "+".
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch


def decision_probe(model_dir: str, max_position: int = 8) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import envs
    from actors.demonstrations import expert_label
    from actors.learner import collate, token_logprobs
    from actors.prompting import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    env = envs.make("numberline", max_position=max_position)
    env.reset(seed=0)
    states, prompts, replies = [], [], []
    for target in range(max_position + 1):
        for current in range(max_position + 1):
            if target == current:
                continue
            env.target, env.current = target, current
            prompt = encode_prompt(tokenizer, env, env._observe(), "")
            for move in ("+", "-"):
                prompts.append(prompt)
                replies.append(expert_label(tokenizer, move))
            states.append((target, current))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    totals = []
    with torch.no_grad():
        for start in range(0, len(prompts), 16):
            batch = collate(prompts[start:start + 16], replies[start:start + 16], pad)
            logp, _ = token_logprobs(model, batch)
            totals += (logp * batch["response_mask"]).sum(dim=1).tolist()
    pairs = torch.tensor(totals).view(-1, 2)  # per state: log p(+ reply), log p(- reply)
    p_plus = torch.softmax(pairs, dim=1)[:, 0]
    expert_plus = torch.tensor([t > c for t, c in states])
    p_expert = torch.where(expert_plus, p_plus, 1 - p_plus)
    return {"model": model_dir, "states": len(states),
            "decision_accuracy": float((p_expert > 0.5).float().mean()),
            "mean_p_expert": float(p_expert.mean()), "prefers_plus_share": float((p_plus > 0.5).float().mean()),
            "mass_on_the_two_replies": float(torch.logsumexp(pairs, dim=1).exp().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", nargs="+")
    parser.add_argument("--max-position", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for d in args.model_dirs:
        print(json.dumps(decision_probe(d, args.max_position)), flush=True)


if __name__ == "__main__":
    main()
