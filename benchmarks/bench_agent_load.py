"""The agent endpoint under load, as a user runs it: `serve run serve_configs/agent.yaml` (its own local Ray
cluster), then N concurrent clients for S seconds alternating `POST /v1/chat/completions` and `POST /v1/act`
(client-side sessions: a new one per request, ended or not), short replies.

Reports requests, errors (goal 0), latency p50 / p99, and the resident memory of the Serve processes (replicas and
proxy), read every few seconds. The goal is memory that stays flat under load (within 10%): growth is measured
from the end of a warm-up of the same load (`--warmup`) to the end of the run, because the step from an idle
endpoint to 64 requests in flight is a one-off working set (threads, buffers, caches) and not growth with the
requests served; the growth from idle is reported beside it. Writes benchmarks/results/bench_agent_load.json.

    python benchmarks/bench_agent_load.py                        # 64 clients, 60 s, 8 tokens
    python benchmarks/bench_agent_load.py --clients 16 --seconds 20 --keep-sessions
    python benchmarks/bench_agent_load.py --engine vllm-async --name agent_load_async   # the async engine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.serve_process import serve_run  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
OBSERVATION = "######\n#P_X_#\n#__O_#\n######"


def serve_pids() -> dict[str, int]:
    """The Serve processes' PIDs by name (one of each here: one replica per deployment)."""
    import psutil

    out: dict[str, int] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith(("ray::ServeReplica", "ray::ProxyActor", "VLLM::EngineCore")):
            out[title.split()[0].split(".")[0]] = proc.pid
    return out


def profile(pids: dict[str, int], seconds: float, work: Path) -> dict[str, Any]:
    """Sample each process with py-spy for `seconds` (while the load runs): the share of samples in which each
    function is on the stack (inclusive) and on top of it (self), the top ten of each, idle threads left out."""
    import subprocess
    from collections import Counter

    spy = Path(sys.executable).with_name("py-spy")
    procs = {name: subprocess.Popen([str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                     "--format", "raw", "--nonblocking", "--output", str(work / f"{pid}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()}
    out: dict[str, Any] = {}
    for name, proc in procs.items():
        proc.wait(timeout=seconds + 60)
        path = work / f"{pids[name]}.txt"
        if not path.exists():
            out[name] = {"error": "py-spy wrote nothing (ptrace not permitted?)"}
            continue
        inclusive: Counter[str] = Counter()
        top: Counter[str] = Counter()
        total = 0
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                      for f in stack.split(";")[1:]]  # the first entry is the thread
            if not frames:
                continue
            total += int(count)
            top[frames[-1]] += int(count)
            for f in set(frames):
                inclusive[f] += int(count)
        out[name] = {"samples": total,
                     "inclusive": {f: round(c / total, 3) for f, c in inclusive.most_common(10)},
                     "self": {f: round(c / total, 3) for f, c in top.most_common(10)}}
    return out


def serve_rss_mib() -> dict[str, float]:
    """Resident memory of the Serve processes of this machine (replicas, proxy, and the async engine's core
    process, a replica's child), by process title."""
    import psutil

    out: dict[str, float] = {}
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        title = " ".join(proc.info["cmdline"] or [])
        if title.startswith(("ray::ServeReplica", "ray::SERVE_REPLICA", "ray::ProxyActor", "VLLM::EngineCore")):
            name = title.split()[0].split(".")[0]
            out[name] = out.get(name, 0.0) + proc.info["memory_info"].rss / 2**20
    return out


def client(url: str, deadline: float, k: int, end_sessions: bool, tokens: int, out: list, errors: list) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=120) as http:
        i = 0
        while time.time() < deadline:
            started = time.perf_counter()
            route = "chat" if (k + i) % 2 == 0 else "act"
            try:
                if route == "chat":
                    r = http.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"client {k} request {i}"}], "max_tokens": tokens})
                else:
                    r = http.post("/v1/act", json={"env": "sokoban", "observation": OBSERVATION,
                                                   "max_tokens": tokens})
                    if r.status_code == 200 and end_sessions:
                        http.delete(f"/v1/act/{r.json()['session_id']}")
                if r.status_code >= 300:
                    errors.append(f"{route} {r.status_code}: {r.text[:200]}")
                else:
                    out.append((route, time.perf_counter() - started))
            except Exception as e:  # a dropped connection or a timeout counts as an error
                errors.append(f"{route} {type(e).__name__}: {e}")
            i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--keep-sessions", action="store_true", help="never DELETE the /v1/act sessions")
    parser.add_argument("--warmup", type=float, default=15.0,
                        help="seconds of the same load before the measured run (its memory is read after it)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory readings")
    parser.add_argument("--name", default="bench_agent_load")
    parser.add_argument("--engine", choices=["auto", "vllm", "vllm-async", "hf"],
                        help="the Policy's engine (default: agent.yaml's)")
    parser.add_argument("--profile", type=float, default=0.0,
                        help="py-spy each Serve process for this many seconds of the measured run")
    args = parser.parse_args()

    import httpx

    spec = yaml.safe_load((REPO_ROOT / "serve_configs" / "agent.yaml").read_text())
    if args.engine:
        spec["applications"][0]["args"]["policy"]["engine"] = args.engine
    work = Path(tempfile.mkdtemp(prefix="raygent-bench-load-"))
    with serve_run(spec, work, "/v1/models") as url:
        first = time.perf_counter()
        httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": args.tokens}, timeout=120)
        first_s = time.perf_counter() - first
        idle = serve_rss_mib()
        timeline: list[dict[str, Any]] = []
        started = time.perf_counter()

        def load(seconds: float, latencies: list, errors: list) -> float:
            """`args.clients` clients for `seconds`, memory read every `args.sample_every` s meanwhile."""
            deadline = time.time() + seconds
            threads = [threading.Thread(target=client, args=(url, deadline, k, not args.keep_sessions, args.tokens,
                                                             latencies, errors)) for k in range(args.clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            while alive := [t for t in threads if t.is_alive()]:
                timeline.append({"t_s": round(time.perf_counter() - started, 1), "rss_mib": serve_rss_mib()})
                alive[0].join(timeout=args.sample_every)
            for t in threads:
                t.join()
            return time.perf_counter() - t0

        if args.warmup:
            load(args.warmup, [], [])
        before = serve_rss_mib()
        latencies: list[tuple[str, float]] = []
        errors: list[str] = []
        profiled: dict[str, Any] = {}
        if args.profile:
            profiler = threading.Thread(target=lambda: profiled.update(profile(serve_pids(), args.profile, work)))
            profiler.start()
        wall = load(args.seconds, latencies, errors)
        after = serve_rss_mib()
        if args.profile:
            profiler.join()

    def pct(values: list[float], q: float) -> float | None:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else None

    def growth(start: dict[str, float], end: dict[str, float]) -> float | None:
        return sum(end.values()) / sum(start.values()) - 1 if start else None

    all_s = [s for _, s in latencies]
    result: dict[str, Any] = {
        "engine": spec["applications"][0]["args"]["policy"]["engine"],
        "clients": args.clients, "seconds": args.seconds, "tokens": args.tokens,
        "sessions_ended": not args.keep_sessions, "requests": len(latencies), "errors": len(errors),
        "error_examples": errors[:5], "requests_per_s": len(latencies) / wall, "first_request_s": first_s,
        "p50_s": pct(all_s, 50), "p99_s": pct(all_s, 99),
        "by_route": {route: {"requests": len(v), "p50_s": pct(v, 50), "p99_s": pct(v, 99)}
                     for route in ("chat", "act") for v in [[s for r, s in latencies if r == route]]},
        "warmup_s": args.warmup, "serve_rss_mib_idle": idle,
        "serve_rss_mib_before": before, "serve_rss_mib_after": after,
        "serve_rss_growth": growth(before, after), "serve_rss_growth_from_idle": growth(idle, after),
        "rss_timeline": timeline, "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "machine_cpus": os.cpu_count(), "profile": profiled,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("by_route", "error_examples", "rss_timeline")},
                     indent=1))
    print(f"wrote benchmarks/results/{args.name}.json")


if __name__ == "__main__":
    main()
