"""How closely the three engines (vLLM synchronous and async, transformers) agree with the trainer's own forward pass
(actors/learner.py) on a real model, in float32 and bfloat16: greedy tokens for chat prompts, and the largest
log-prob gap on the same tokens up to the first near-tie (top-2 margin below 1e-3). The tolerances the tests and
docs state come from here.

Usage (from the repo root):  python benchmarks/bench_engine_agreement.py [--model smollm2-135m] [--dtypes float32,bfloat16]
Writes benchmarks/results/bench_engine_agreement.json. Starts (and stops) its own local Ray cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from actors.learner import collate, token_logprobs  # noqa: E402
from app.default_model import resolve_model  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "bench_engine_agreement.json"
PROMPTS = ["What is 12 + 30? Answer with the number.",
           "Name three colours.",
           "Number line: move Current to Target. '+' adds 1, '-' subtracts 1.\nTarget: 4\nCurrent: 1\n"
           "Reply with your chosen action inside <action></action>, e.g. <action>+</action>"]
TIE_MARGIN = 1e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from transformers import AutoModelForCausalLM

    from app.policy import Policy

    path = resolve_model(args.model)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    greedy = {"temperature": 0.0, "max_tokens": args.max_tokens, "seed": 0}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out: dict = {"model": args.model, "max_tokens": args.max_tokens, "tie_margin": TIE_MARGIN, "dtypes": {}}
    try:
        for dtype in args.dtypes.split(","):
            trainer = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
            result: dict = {}
            for engine in ("vllm", "vllm-async", "hf"):
                handle = serve.run(Policy.options(num_replicas=1).bind(
                    {"model": path, "engine": engine, "dtype": dtype, "max_model_len": 1024}),
                    name="agreement", route_prefix=None)
                replies = handle.generate.remote(chats, greedy).result(timeout_s=600)
                serve.delete("agreement")
                per_prompt = []
                for reply in replies:
                    prompt, tokens = reply["prompt_token_ids"], reply["token_ids"]
                    with torch.no_grad():
                        logits = trainer(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
                        logp, _ = token_logprobs(trainer, collate([prompt], [tokens], pad_id=0))
                    top2 = torch.log_softmax(logits, -1).topk(2, -1).values
                    greedy_ids = logits.argmax(-1).tolist()
                    tied = [k for k, (a, b) in enumerate(top2.tolist()) if a - b < TIE_MARGIN]
                    upto = min([len(tokens), *tied])
                    gap = np.abs(np.asarray(reply["logprobs"][:upto]) - logp[0, :upto].float().numpy())
                    per_prompt.append({"tokens": len(tokens), "first_near_tie": upto,
                                       "trainer_greedy_agrees": greedy_ids[:upto] == tokens[:upto],
                                       "max_logprob_gap": float(gap.max()) if len(gap) else 0.0,
                                       "text": reply["text"]})
                result[engine] = {"prompts": per_prompt,
                                  "max_logprob_gap": max(p["max_logprob_gap"] for p in per_prompt)}
                print(f"[{dtype}] {engine}: max log-prob gap {result[engine]['max_logprob_gap']:.2e}; greedy agrees "
                      f"{[p['trainer_greedy_agrees'] for p in per_prompt]}", flush=True)
            tokens = {e: [p["text"] for p in r["prompts"]] for e, r in result.items()}
            result["same_text_all_engines"] = [len({tokens[e][i] for e in tokens}) == 1 for i in range(len(PROMPTS))]
            out["dtypes"][dtype] = result
    finally:
        serve.shutdown()
        ray.shutdown()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
