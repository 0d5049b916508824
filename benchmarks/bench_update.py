"""The Train job's update on the built-in real model (`smollm2-135m`): trained tokens per second and peak memory,
full fine-tuning vs LoRA, 1 rank vs 2 FSDP2 ranks, on this machine's cores.

Each variant runs in fresh processes the way a Train worker builds its model (`actors.trainer.setup_models`: float32
master weights, FSDP2 per decoder layer over gloo on 2 ranks, a LoRA adapter when set) and takes RL steps
(`actors.learner.rl_step`: PPO-clip loss, the optimizer step) on rows shaped like the real-model recipe's
(`serve_configs/smollm2_numberline_cpu.yaml`: short replies after prompts of about 160 tokens), split evenly over
the ranks. 1 rank gets every core's threads, 2 ranks one thread each, so both variants use the whole machine. The
first step warms up and is not timed. Variants run in turn, `--rounds` times, so each ratio is measured within a
round on the same machine state. Memory is each rank's peak resident set (ru_maxrss), model load included.

Usage (from the repo root):  python benchmarks/bench_update.py [--rows 32] [--prompt 160] [--reply 12] [--steps 3]
Writes benchmarks/results/bench_update_smollm2-135m.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
RESULTS = REPO_ROOT / "benchmarks" / "results"
LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]}
VARIANTS = [("full", 1), ("full", 2), ("lora", 1), ("lora", 2)]


def make_rows(n: int, prompt: int, reply: int, vocab: int, seed: int = 0) -> dict[str, list]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"prompt_ids": [rng.integers(100, vocab, size=prompt).tolist() for _ in range(n)],
            "response_ids": [rng.integers(100, vocab, size=reply).tolist() for _ in range(n)],
            "rollout_logprobs": [(-3.0 + 0.3 * rng.standard_normal(reply)).tolist() for _ in range(n)],
            "advantage": rng.standard_normal(n).round(3).tolist()}


def rank_main(rank: int, world: int, port: int, model: str, kind: str, rows: dict[str, list], steps: int,
              micro_batch: int, out: str) -> None:
    """One rank: the model as a Train worker builds it, `steps` RL steps on its share of the rows."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from actors.config import OptimConfig
    from actors.learner import ALONE, Collective, rl_step
    from actors.trainer import setup_models

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    optim = OptimConfig(lr=1e-5, minibatch_size=10_000, micro_batch_size=micro_batch, kl_coef=0.0,
                        old_logprobs="rollout")
    cfg = {"use_gpu": False, "strategy": "fsdp", "model_path": model, "optim": optim.model_dump(),
           "lora": LORA if kind == "lora" else None}
    policy, ref, device, _, autocast = setup_models(cfg, world)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=optim.lr)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)  # an FSDP2 DTensor counts whole
    mine = {k: v[rank::world] for k, v in rows.items()}
    collective = Collective.from_torch() if world > 1 else ALONE
    seconds = []
    for _ in range(steps + 1):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        rl_step(policy, optimizer, mine, optim, lr=optim.lr, norm_length=32, pad_id=2, device=device,
                rng=np.random.default_rng(0), collective=collective, ref_model=ref, autocast_dtype=autocast)
        if world > 1:
            dist.barrier()
        seconds.append(time.perf_counter() - t0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(f"{out}.{rank}").write_text(json.dumps({"seconds": seconds[1:], "peak_rss_mb": peak_mb,
                                                 "trainable_params": trainable}))
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(model: str, kind: str, world: int, rows: dict[str, list], steps: int, micro_batch: int,
                work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = str(work / f"{kind}_{world}")
    mp.start_processes(rank_main, args=(world, free_port(), model, kind, rows, steps, micro_batch, out),
                       nprocs=world, start_method="spawn", join=True)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    seconds = ranks[0]["seconds"]
    return {"seconds": seconds, "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
            "trainable_params": ranks[0]["trainable_params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=160)
    parser.add_argument("--reply", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3, help="timed RL steps per variant (after one warm-up)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoConfig

    from app.default_model import resolve_model

    model = resolve_model("smollm2-135m")
    rows = make_rows(args.rows, args.prompt, args.reply, AutoConfig.from_pretrained(model).vocab_size)
    trained_tokens = args.rows * args.reply
    forward_tokens = args.rows * (args.prompt + args.reply)
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-update-"))
    rounds = []
    for k in range(args.rounds):
        measured = {}
        for kind, world in VARIANTS:
            r = run_variant(model, kind, world, rows, args.steps, args.micro_batch, work)
            step = statistics.median(r["seconds"])
            measured[f"{kind}_{world}"] = {**r, "step_s": step, "trained_tokens_per_s": trained_tokens / step,
                                           "forward_tokens_per_s": forward_tokens / step}
            print(f"round {k}: {kind:4s} x{world}: {step:6.2f} s/step, {forward_tokens / step:7.1f} tokens/s "
                  f"(prompt + reply), peak RSS {max(r['peak_rss_mb_per_rank']):.0f} MB/rank", flush=True)
        ratios = {"two_ranks_vs_one_full": measured["full_1"]["step_s"] / measured["full_2"]["step_s"],
                  "two_ranks_vs_one_lora": measured["lora_1"]["step_s"] / measured["lora_2"]["step_s"],
                  "lora_vs_full_one_rank": measured["full_1"]["step_s"] / measured["lora_1"]["step_s"],
                  "lora_vs_full_two_ranks": measured["full_2"]["step_s"] / measured["lora_2"]["step_s"]}
        rounds.append({"variants": measured, "speedups": ratios})
        print(f"round {k} speedups: " + ", ".join(f"{n} {v:.2f}x" for n, v in ratios.items()), flush=True)

    def summary(name: str) -> dict[str, float | None]:
        xs = [r["speedups"][name] for r in rounds]
        return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None}

    result = {"model": "smollm2-135m", "cores": os.cpu_count(), "rows": args.rows, "prompt_tokens": args.prompt,
              "reply_tokens": args.reply, "micro_batch": args.micro_batch, "lora": LORA, "steps": args.steps,
              "rounds": rounds, "speedups": {n: summary(n) for n in rounds[0]["speedups"]}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "bench_update_smollm2-135m.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
