"""The served agent against the run's own validation, the way a user checks it: serve a checkpoint with nothing but
its path (`serve run app.agent:build_agent_app model=<checkpoint>/model`, its own local Ray cluster), play held-out
rooms through `POST /v1/episodes` with only the seed and the split, and compare the success rate with the run's
validation at that checkpoint (read from the run's metrics.jsonl): once with the seed and split only, once with the
validation's own sampling seeds (the same draws, so the same episodes if the served agent is the trained one).

    python benchmarks/bench_served_agent.py --checkpoint runs/sokoban-gigpo/checkpoints/iter_000050
Writes benchmarks/results/bench_served_agent.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.serve_process import serve_run  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def run_validation(checkpoint: Path) -> dict[str, Any] | None:
    """The run's validation record at the checkpoint's iteration (or the last before it)."""
    state = json.loads((checkpoint / "state.json").read_text())
    metrics = checkpoint.parent.parent / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    val = [r for r in records if r.get("val/success_rate") is not None and r.get("iteration", 0) <= state["iteration"]]
    return val[-1] if val else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="runs/<run>/checkpoints/iter_N")
    parser.add_argument("--seeds", type=int, default=256, help="held-out seeds played through /v1/episodes (the "
                                                                  "default run validates on 256)")
    parser.add_argument("--name", default="bench_served_agent")
    args = parser.parse_args()

    import httpx

    import envs
    from actors.checkpoint import read_agent_card
    from actors.evaluation import heldout_sampling_seed

    model = (args.checkpoint / "model").resolve()
    card = read_agent_card(model)
    run_seed = int(card.source.get("seed", 0))
    seeds = envs.group_seeds(run_seed, 0, args.seeds, "val").tolist()
    spec = {"applications": [{"name": "agent", "route_prefix": "/", "import_path": "app.agent:build_agent_app",
                              "args": {"policy": {"model": str(model)}}}]}
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-served-"))
    with serve_run(spec, work, "/v1/agent") as url:
        def play(k: int, sampled: bool) -> bool:
            body: dict[str, Any] = {"seed": seeds[k], "split": card.heldout_split}
            if sampled:  # the validation's own sampling seed: the same draw as the run's validation
                body["sampling_seed"] = heldout_sampling_seed(run_seed, k, 0)
            r = httpx.post(f"{url}/v1/episodes", json=body, timeout=600)
            r.raise_for_status()
            return bool(r.json()["won"])

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            plain = list(pool.map(lambda k: play(k, False), range(len(seeds))))
            replayed = list(pool.map(lambda k: play(k, True), range(len(seeds))))
        seconds = time.perf_counter() - t0
    val = run_validation(args.checkpoint)
    result = {
        "checkpoint": str(args.checkpoint), "card": card.model_dump(), "heldout_seeds": len(seeds),
        "served_success_seed_and_split_only": sum(plain) / len(plain),
        "served_success_with_validation_sampling_seeds": sum(replayed) / len(replayed),
        "run_validation": {k: v for k, v in (val or {}).items() if k.startswith("val/") or k == "iteration"},
        "seconds": seconds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "card"}, indent=1))


if __name__ == "__main__":
    main()
