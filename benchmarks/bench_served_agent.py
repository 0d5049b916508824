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
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
RESULTS = REPO_ROOT / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="raygent-bench-served-")) / "serve.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # `serve run IMPORT_PATH key=value` binds 127.0.0.1:8000 by default; the port here keeps it free for a user.
    config = log.parent / "agent.yaml"
    config.write_text(json.dumps({
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "agent", "route_prefix": "/", "import_path": "app.agent:build_agent_app",
                          "args": {"policy": {"model": str(model)}}}]}))
    proc = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config)], cwd=REPO_ROOT,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve run exited; see {log}")
            try:
                if httpx.get(f"{url}/v1/agent", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - started > 600:
                raise SystemExit(f"the endpoint did not come up; see {log}")
            time.sleep(2)

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
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
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
