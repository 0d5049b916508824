"""Learning curves of the real training app, run exactly as a user runs it (`serve run CONFIG` in a subprocess,
on its own local Ray cluster), read back from the run's metrics.jsonl.

Default: the embedded default (`serve_configs/train.yaml`, what `make train` runs) for a wall-clock budget. The
curve shows the random-valid-action level and the untrained policy on the held-out validation seeds, the
supervised warm start, then the RL iterations (validation at the config's temperature, and the sampled training rollouts).

`--compare`: advantage estimators on the same budget. One supervised warm start (`raygent sft` on the config),
then for every seed and estimator an RL run from that checkpoint with the same number of iterations (the same
number of episodes; env steps are counted and plotted). Validation success vs env steps, mean +- sample std over
seeds, the largest approx-KL of each run, the runs that collapsed (training valid-action ratio below 50% at some
iteration), paired differences to GRPO on the same seed, and GiGPO's step-group statistics per iteration.
The results file is rewritten after every run; `--continue` adds runs to an existing one (same warm start, kept in
`--work`), so a long comparison can be spread over several sittings.

Usage (from the repo root):
    python benchmarks/bench_learning.py                       # train.yaml, 15 minutes
    python benchmarks/bench_learning.py --minutes 5 --name quick --set rollout.n_groups=8
    python benchmarks/bench_learning.py --compare             # gigpo (2 modes), grpo, rloo, hgpo x seeds 0,1,2
    python benchmarks/bench_learning.py --compare --continue --estimators grpo --seeds 3,4   # more seeds later
Writes benchmarks/results/learning_<name>.json and .png (compare: compare_<name>.json and .png).
"""

from __future__ import annotations

import argparse
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

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from app.sft import set_dotted  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
FINAL_PHASES = {"done", "stopped", "failed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_run_config(config: Path, work: Path, run_name: str, overrides: dict[str, Any],
                     deployments: dict[str, dict[str, Any]] | None = None) -> tuple[Path, int, Path]:
    """The config a benchmark run serves: its own port, run folder and name, the app's args overridden, and fields
    of named deployments set (None removes one, e.g. num_replicas where autoscaling_config takes over)."""
    spec = yaml.safe_load(config.read_text())
    port = free_port()
    spec.setdefault("http_options", {})["port"] = port
    args = spec["applications"][0]["args"]
    args["output_dir"] = str(work / "runs")
    args["run_name"] = run_name
    args.setdefault("checkpoint", {})["resume"] = "never"
    for key, value in overrides.items():
        set_dotted(args, key, value)
    for deployment in spec["applications"][0].get("deployments", []):
        for key, value in (deployments or {}).get(deployment["name"], {}).items():
            if value is None:
                deployment.pop(key, None)
            else:
                deployment[key] = value
    path = work / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, port, work / "runs" / run_name


def get_json(url: str, method: str = "GET") -> Any:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
        return json.loads(r.read())


def run_training(config: Path, run_name: str, overrides: dict[str, Any], minutes: float, work: Path,
                 log_every_s: float = 60.0, deployments: dict[str, dict[str, Any]] | None = None,
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`serve run` the config; stop gracefully (POST /stop) when the budget is spent; return the metrics records
    and facts about the run. Times are seconds since `serve run` was launched."""
    path, port, run_dir = write_run_config(config, work, run_name, overrides, deployments)
    url = f"http://127.0.0.1:{port}"
    log = work / f"{run_name}.log"
    serve = str(Path(sys.executable).with_name("serve"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # its own local cluster, as `make train` has
    launched = time.time()
    proc = subprocess.Popen([serve, "run", str(path)], cwd=REPO_ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    status: dict[str, Any] = {}
    stop_sent, last_print = False, 0.0
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
            elapsed = time.time() - launched
            try:
                status = get_json(f"{url}/status")
            except OSError:
                status = status or {}
            phase = status.get("phase")
            if phase in FINAL_PHASES:
                break
            if elapsed > minutes * 60 and not stop_sent and status:
                get_json(f"{url}/stop", method="POST")  # finish the iteration, checkpoint, stop
                stop_sent = True
            if elapsed > minutes * 60 + 600:
                raise RuntimeError(f"run did not stop within 10 minutes of POST /stop; see {log}")
            if time.time() - last_print > log_every_s:
                last_print = time.time()
                metrics = status.get("last_metrics") or {}
                print(f"  [{run_name}] {elapsed / 60:5.1f} min: phase {phase}, iteration {status.get('iteration')}, "
                      f"val success {metrics.get('val/success_rate')}", flush=True)
            time.sleep(5.0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for r in records:
        r["minutes"] = (r["time"] - launched) / 60
    return records, {"phase": status.get("phase"), "iterations": status.get("iteration"), "log": str(log),
                     "wall_minutes": (time.time() - launched) / 60}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    def first(phase: str, key: str) -> float | None:
        return next((r[key] for r in records if r.get("phase") == phase and r.get(key) is not None), None)

    warm = [r for r in records if r.get("phase") == "warm_start"]
    rl = [r for r in records if r.get("phase") == "train"]
    val = [(r["iteration"], r["minutes"], r["val/success_rate"]) for r in rl if r.get("val/success_rate") is not None]
    out: dict[str, Any] = {
        "random_policy_success": first("baseline", "val/random_policy_success"),
        "untrained_success": first("untrained", "val/success_rate"),
        "warm_start": [{"step": r["warm_start/step"], "minutes": r["minutes"], "val_success": r["val/success_rate"]}
                       for r in warm],
        "rl_validation": [{"iteration": i, "minutes": m, "val_success": s} for i, m, s in val],
        "rl_train_rollouts": [{"iteration": r["iteration"], "minutes": r["minutes"],
                               "success": r.get("train/success_rate"), "return": r.get("train/return"),
                               "valid_action_ratio": r.get("train/valid_action_ratio")} for r in rl],
        "mean_iteration_seconds": (sum(r.get("time/iteration_s", 0.0) for r in rl) / len(rl)) if rl else None,
    }
    out["warm_start_final_success"] = warm[-1]["val/success_rate"] if warm else None
    out["warm_start_minutes"] = warm[-1]["minutes"] if warm else None
    out["rl_final_success"] = val[-1][2] if val else None
    out["rl_best_success"] = max((s for _, _, s in val), default=None)
    return out


def plot(records: list[dict[str, Any]], summary: dict[str, Any], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if summary["random_policy_success"] is not None:
        ax.axhline(summary["random_policy_success"], color="gray", ls="--", lw=1,
                   label=f"random valid action ({summary['random_policy_success']:.0%})")
    untrained = [r for r in records if r.get("phase") == "untrained"]
    if untrained:
        ax.plot([r["minutes"] for r in untrained], [r["val/success_rate"] for r in untrained], "ks",
                label=f"untrained ({untrained[0]['val/success_rate']:.0%})")
    warm = summary["warm_start"]
    if warm:
        ax.plot([w["minutes"] for w in warm], [w["val_success"] for w in warm], "o-", color="tab:blue",
                label="supervised warm start (held-out)")
        ax.axvline(warm[-1]["minutes"], color="tab:blue", lw=0.8, alpha=0.5)
    rollouts = [r for r in summary["rl_train_rollouts"] if r["success"] is not None]
    if rollouts:
        ax.plot([r["minutes"] for r in rollouts], [r["success"] for r in rollouts], "-", color="tab:orange",
                alpha=0.35, label="RL training rollouts (sampled, T=1)")
    val = summary["rl_validation"]
    if val:
        ax.plot([v["minutes"] for v in val], [v["val_success"] for v in val], "o-", color="tab:red",
                label="RL (GiGPO), held-out")
    ax.set_xlabel("minutes since `serve run` (incl. start-up)")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ESTIMATORS = {
    "gigpo-mean_norm": {"estimator": "gigpo", "params": {"gamma": 0.95, "step_weight": 1.0, "mode": "mean_norm"}},
    "gigpo-mean_std_norm": {"estimator": "gigpo",
                            "params": {"gamma": 0.95, "step_weight": 1.0, "mode": "mean_std_norm"}},
    "grpo": {"estimator": "grpo", "params": {}},
    "rloo": {"estimator": "rloo", "params": {}},
    # the recipe's defaults: contexts of 1-3 states, weights (k + 1)^1, population-std normalisation
    "hgpo": {"estimator": "hgpo", "params": {"gamma": 0.95, "history_length": 2, "alpha": 1.0,
                                             "mode": "mean_std_norm"}},
}
COLLAPSE_VALID_RATIO = 0.5  # a run whose training rollouts fall below this share of valid replies has collapsed


def warm_start_once(config: Path, work: Path, overrides: dict[str, Any]) -> Path:
    """The shared starting point: `raygent sft` on the config's warm_start section (reused when `work` has it)."""
    out = work / "sft"
    if (out / "config.json").exists():
        print(f"warm start: reusing {out}", flush=True)
        return out
    cmd = [str(Path(sys.executable).with_name("raygent")), "sft", "--config", str(config), "--out", str(out)]
    for key, value in overrides.items():
        if key.startswith("warm_start.") and key.split(".", 1)[1] in ("steps", "lr", "batch_size", "target_success"):
            cmd += [f"--{key.split('.', 1)[1].replace('_', '-')}", str(value)]
    print("warm start:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return out


def run_curve(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    import numpy as np

    rl = [r for r in records if r.get("phase") == "train"]
    steps = np.cumsum([r.get("data/rows") or r.get("train/rows") or 0 for r in rl]).tolist()
    curve = {"env_steps": [], "val_success": [], "val_return": [], "iteration": []}
    for r, n in zip(rl, steps, strict=True):
        if r.get("val/success_rate") is not None:
            curve["env_steps"].append(n)
            curve["val_success"].append(r["val/success_rate"])
            curve["val_return"].append(r.get("val/return"))
            curve["iteration"].append(r["iteration"])
    curve["step_group_share"] = [r.get("data/step_group_share") for r in rl]
    curve["step_group_mean_size"] = [r.get("data/step_group_mean_size") for r in rl]
    curve["train_success"] = [r.get("train/success_rate") for r in rl]
    curve["train_valid_action_ratio"] = [r.get("train/valid_action_ratio") for r in rl]
    curve["approx_kl"] = [r.get("train/approx_kl") for r in rl]
    curve["kl_to_reference"] = [r.get("train/kl") for r in rl]
    return curve


def run_facts(curve: dict[str, list]) -> dict[str, Any]:
    kl = [v for v in curve["approx_kl"] if v is not None]
    valid = [v for v in curve["train_valid_action_ratio"] if v is not None]
    return {"max_approx_kl": max(kl, default=None), "min_train_valid_action_ratio": min(valid, default=None),
            "collapsed": bool(valid) and min(valid) < COLLAPSE_VALID_RATIO}


def compare(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    work = Path(args.work or REPO_ROOT / "runs" / f"bench-compare-{args.name}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = args.estimators.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    start = warm_start_once(args.config, work, overrides)
    start_success = warm_start_success(start)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    done_before: set[tuple[str, int]] = set()
    results_file = RESULTS / f"compare_{args.name}.json"
    if args.continue_ and results_file.exists():
        previous = json.loads(results_file.read_text())
        if previous.get("overrides") != overrides or previous.get("iterations") != args.iterations:
            raise SystemExit(f"--continue: {results_file} was made with other overrides or iterations")
        for name, rs in previous["runs"].items():
            runs.setdefault(name, []).extend(rs)
            done_before |= {(name, r["seed"]) for r in rs}
        seeds_all = sorted(set(previous["seeds"]) | set(seeds))
    else:
        seeds_all = seeds
    todo = [(seed, name) for seed in seeds for name in names if (name, seed) not in done_before]
    for seed, name in todo:
        spec = ESTIMATORS[name]
        run_overrides = {**overrides, "policy.model": str(start), "warm_start.enabled": False,
                         "algorithm.estimator": spec["estimator"], "algorithm.params": spec["params"],
                         "seed": seed, "iterations": args.iterations, "checkpoint.every": 0}
        print(f"{name}, seed {seed}: {args.iterations} iterations", flush=True)
        try:
            records, run = run_training(args.config, f"{name}-s{seed}", run_overrides, 1e6, work)
        except RuntimeError as e:  # e.g. the local cluster failed to start on a busy machine: one more try
            print(f"  run failed ({str(e).splitlines()[0]}); retrying once", flush=True)
            time.sleep(30)
            records, run = run_training(args.config, f"{name}-s{seed}", run_overrides, 1e6, work)
        curve = run_curve(records)
        runs[name].append({"seed": seed, "run": run, "curve": curve, **run_facts(curve),
                           "random_policy_success": summarize(records)["random_policy_success"]})
        print(f"  final val success {curve['val_success'][-1] if curve['val_success'] else None}, "
              f"{run_facts(curve)}", flush=True)
        # Written after every run, so a run cut short still leaves every finished run on disk.
        write_compare(args, overrides, seeds_all, start_success, runs, complete=(seed, name) == todo[-1])
    if not todo:
        write_compare(args, overrides, seeds_all, start_success, runs, complete=True)


def warm_start_success(folder: Path) -> float | None:
    """The warm start's own held-out success, from what `raygent sft` recorded in the folder."""
    for name in ("raygent_agent.json", "raygent_sft.json"):
        if (folder / name).exists():
            data = json.loads((folder / name).read_text())
            return data.get("sft", data).get("final_success")
    return None


def write_compare(args: argparse.Namespace, overrides: dict[str, Any], seeds: list[int],
                  start_success: float | None, runs: dict[str, list[dict[str, Any]]], complete: bool) -> None:
    import numpy as np

    done = {name: sorted(rs, key=lambda r: r["seed"]) for name, rs in runs.items()
            if rs and all(r["curve"]["val_success"] for r in rs)}
    grpo = {r["seed"]: r["curve"]["val_success"][-1] for r in done.get("grpo", [])}
    table = {}
    for name, rs in done.items():
        finals = np.array([r["curve"]["val_success"][-1] for r in rs])
        reach = [next((n for n, v in zip(r["curve"]["env_steps"], r["curve"]["val_success"], strict=True)
                       if v >= args.reach), None) for r in rs]
        share = [v for r in rs for v in r["curve"]["step_group_share"] if v is not None]
        size = [v for r in rs for v in r["curve"]["step_group_mean_size"] if v is not None]
        paired = [r["curve"]["val_success"][-1] - grpo[r["seed"]] for r in rs if r["seed"] in grpo]
        table[name] = {"seeds": [r["seed"] for r in rs], "final_val_success_mean": float(finals.mean()),
                       # sample std over seeds (ddof=1)
                       "final_val_success_std": float(finals.std(ddof=1)) if len(finals) > 1 else None,
                       "finals": finals.tolist(), f"env_steps_to_{args.reach}": reach,
                       "max_approx_kl": [r["max_approx_kl"] for r in rs],
                       "collapsed_runs": int(sum(r["collapsed"] for r in rs)),
                       "minus_grpo_same_seed": paired if name != "grpo" else None,
                       "minus_grpo_mean": float(np.mean(paired)) if paired and name != "grpo" else None,
                       "minus_grpo_std": float(np.std(paired, ddof=1)) if len(paired) > 1 and name != "grpo"
                       else None,
                       "step_group_share_mean": float(np.mean(share)) if share else None,
                       "step_group_mean_size": float(np.mean(size)) if size else None}
        if complete:
            row = table[name]
            print(f"{name:22s} final val success {finals.mean():.3f} +- {row['final_val_success_std'] or 0:.3f} "
                  f"(n={len(rs)}), collapsed {row['collapsed_runs']}, max approx KL "
                  f"{max(v or 0 for v in row['max_approx_kl']):.3f}, minus GRPO {row['minus_grpo_mean']}",
                  flush=True)
    out = {"config": str(args.config), "overrides": overrides, "iterations": args.iterations, "seeds": seeds,
           "complete": complete, "warm_start_success": start_success, "reach_threshold": args.reach,
           "table": table, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"compare_{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    if done:
        plot_compare(done, out, RESULTS / f"compare_{args.name}.png")
    if complete:
        print(f"wrote benchmarks/results/compare_{args.name}.json and .png")


def plot_compare(runs: dict[str, list[dict[str, Any]]], out: dict[str, Any], path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rs in runs.items():
        n = min(len(r["curve"]["val_success"]) for r in rs)
        x = np.mean([r["curve"]["env_steps"][:n] for r in rs], axis=0)
        y = np.array([r["curve"]["val_success"][:n] for r in rs])
        sd = y.std(0, ddof=1) if len(rs) > 1 else np.zeros(n)  # sample std over seeds
        ax.plot(x, y.mean(0), "o-", label=f"{name} (n={len(rs)})")
        ax.fill_between(x, y.mean(0) - sd, y.mean(0) + sd, alpha=0.15)
        share = [r["curve"]["step_group_share"] for r in rs if any(v is not None for v in r["curve"]["step_group_share"])]
        if name.startswith(("gigpo", "hgpo")) and share:
            m = min(len(s) for s in share)
            ax2.plot(range(1, m + 1), np.mean([s[:m] for s in share], axis=0), label=f"{name}: share of rows")
    random_level = next((r["random_policy_success"] for rs in runs.values() for r in rs
                         if r["random_policy_success"] is not None), None)
    if random_level is not None:
        ax.axhline(random_level, color="gray", ls="--", lw=1, label=f"random valid action ({random_level:.0%})")
    if out.get("warm_start_success") is not None:
        ax.axhline(out["warm_start_success"], color="tab:blue", ls=":", lw=1,
                   label=f"warm start ({out['warm_start_success']:.0%})")
    ax.set_xlabel("env steps (training)")
    ax.set_ylabel("held-out success rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("validation success, mean +- sample std over seeds")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("share of step rows in step groups of size > 1")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    ax2.set_title("GiGPO anchor-state groups")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "serve_configs" / "train.yaml")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget, start-up included")
    parser.add_argument("--name", default="sokoban-default", help="results file stem: learning_<name>")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a train arg, e.g. warm_start.steps=1000 (repeatable)")
    parser.add_argument("--compare", action="store_true", help="estimators x seeds from one warm start")
    parser.add_argument("--estimators", default=",".join(ESTIMATORS), help=f"subset of {list(ESTIMATORS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--iterations", type=int, default=20, help="RL iterations per compared run")
    parser.add_argument("--reach", type=float, default=0.5, help="report env steps to this validation success")
    parser.add_argument("--work", help="compare: folder for the warm start and the runs (default runs/bench-compare-"
                                       "<name>; an existing warm start there is reused)")
    parser.add_argument("--continue", dest="continue_", action="store_true",
                        help="compare: add the runs not yet in benchmarks/results/compare_<name>.json to it")
    args = parser.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.compare:
        unknown = set(args.estimators.split(",")) - set(ESTIMATORS)
        if unknown:
            parser.error(f"unknown estimators {sorted(unknown)}; allowed: {list(ESTIMATORS)}")
        compare(args, overrides)
        return

    work = Path(tempfile.mkdtemp(prefix="raygent-bench-learning-"))
    print(f"running {args.config} for {args.minutes} min (work dir {work})", flush=True)
    records, run = run_training(args.config, args.name, overrides, args.minutes, work)
    summary = summarize(records)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"config": str(args.config.relative_to(REPO_ROOT) if args.config.is_absolute() else args.config),
           "overrides": overrides, "minutes_budget": args.minutes, "run": run, "machine_cpus": os.cpu_count(),
           "summary": summary, "records": records}
    (RESULTS / f"learning_{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(records, summary, f"{args.name}: held-out success, {os.cpu_count()} CPU cores",
         RESULTS / f"learning_{args.name}.png")
    s = summary
    print(f"random valid action {s['random_policy_success']}, untrained {s['untrained_success']}, warm start "
          f"{s['warm_start_final_success']} after {s['warm_start_minutes']} min, RL final {s['rl_final_success']} "
          f"(best {s['rl_best_success']}) after {run['iterations']} iterations, {run['wall_minutes']:.1f} min")
    print(f"wrote benchmarks/results/learning_{args.name}.json and .png")


if __name__ == "__main__":
    main()
