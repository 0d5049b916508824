"""`raygent train CONFIG` (what `make train` runs): `serve run CONFIG` in a child process, followed over HTTP until
the run ends, with a console that reads well.

The framework logs (Ray, Serve, vLLM, Ray Train) go to `<run folder>/serve.log`; the console shows one line per
phase, warm-start evaluation, validation and iteration, from the run's own metrics. When the run ends it says where
the checkpoint is and the one command that serves it, stops `serve run`, and exits with the run's outcome: 0 done
(or stopped), 1 failed, 2 a bad config. Ctrl-C or SIGTERM asks the run to stop (`POST /stop`: finish the iteration,
checkpoint); a second one stops at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from actors.config import load_train_config, run_storage
from app.sft import TRAIN_APP, read_config_file, set_dotted

FINAL = ("done", "stopped", "failed")
MAJOR_PHASES = {"starting": "starting the controller, env-group actors and the Train job",
                "baseline": "baselines (random actions, the untrained policy)",
                "warm_start": "supervised warm start", "training": "RL"}


def _request(url: str, method: str = "GET", timeout: float = 3.0) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as r:
        return json.loads(r.read())


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _line(r: dict[str, Any]) -> str | None:
    """One console line for a metrics record (None for records that need none)."""
    phase = r.get("phase")
    if phase == "baseline" and r.get("val/random_policy_success") is not None:
        return f"baseline: a random admissible action wins {100 * r['val/random_policy_success']:.1f}% of held-out seeds"
    if phase == "untrained":
        return f"untrained policy: held-out success {100 * (r.get('val/success_rate') or 0):.1f}%"
    if phase == "warm_start":
        return (f"warm start step {r.get('warm_start/step')}: loss {r.get('warm_start/sft_loss') or float('nan'):.3f}, "
                f"held-out success {100 * (r.get('val/success_rate') or 0):.1f}%")
    if phase == "train":
        val = f" | held-out {100 * r['val/success_rate']:.1f}%" if r.get("val/success_rate") is not None else ""
        return (f"iter {r['iteration']} | success {100 * (r.get('train/success_rate') or 0):.1f}% | valid "
                f"{100 * (r.get('train/valid_action_ratio') or 0):.1f}% | KL {r.get('train/approx_kl') or 0:.4f} | "
                f"{r.get('time/iteration_s') or 0:.1f}s{val}")
    return None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` flags as {dotted key: value}, each value read as YAML (`3`, `true`, `{gpu_node: 1}`)."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set checkpoint.storage=s3://bucket/runs")
        try:
            overrides[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {key}: {value!r} is not a YAML value ({e})") from None
    return overrides


DEPLOYMENTS = "deployments."


def apply_overrides(spec: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The Serve config `spec` with `--set` overrides ({dotted key: value}) applied in place: a key
    `deployments.NAME.FIELD...` to the training app's deployment NAME (e.g. `deployments.Policy.num_replicas=1`,
    `deployments.Policy.ray_actor_options.num_gpus=0`: what a GPU recipe asks of Serve), any other to its args."""
    (app,) = [a for a in spec["applications"] if a.get("import_path") == TRAIN_APP]
    args = app.setdefault("args", {})
    deployments = {d["name"]: d for d in app.setdefault("deployments", [])}
    for key, value in overrides.items():
        if not key.startswith(DEPLOYMENTS):
            set_dotted(args, key, value)
            continue
        name, _, field = key[len(DEPLOYMENTS):].partition(".")
        if name not in deployments:
            raise ValueError(f"--set {key}: the training app has no deployment {name!r}; its deployments: "
                             f"{', '.join(deployments) or 'none listed'}")
        if not field:
            raise ValueError(f"--set {key}: name a field of deployment {name!r}, e.g. {key}.num_replicas=1")
        set_dotted(deployments[name], field, value)
    return spec


def _write_config(config: Path, spec: dict[str, Any], overrides: dict[str, Any], run_dir: Path) -> Path:
    """The Serve config with the overrides applied, written beside the run's logs (what `serve run` is given, and a
    record of what ran)."""
    path = run_dir / f"serve_config.{config.stem}.yaml"
    path.write_text(f"# {config} with {' '.join(f'--set {k}={v}' for k, v in overrides.items())}\n"
                    + yaml.safe_dump(spec, sort_keys=False))
    return path


def train(config: str | Path, out=print, overrides: dict[str, Any] | None = None) -> int:
    """Run the training Serve config to its end, its app's args changed by `overrides` ({dotted key: value}, as
    `--set` gives them); the exit code of `raygent train`."""
    config = Path(config)
    try:
        args = read_config_file(config)
        spec = yaml.safe_load(config.read_text()) or {}
        if overrides and "applications" not in spec:
            raise ValueError(f"--set needs a Serve config (with applications:), and {config} is a bare args file")
        for key, value in (overrides or {}).items():
            if not key.startswith(DEPLOYMENTS):
                set_dotted(args, key, value)
        cfg = load_train_config(args)
        run_storage(cfg)
        if overrides:
            apply_overrides(spec, overrides)
    except ValueError as e:
        out(f"raygent train: {e}")
        return 2
    http = spec.get("http_options") or {}
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    if _port_in_use(host, port):
        out(f"raygent train: {host}:{port} is already in use (another run or agent?): stop it, or set "
            "http_options.port in the config")
        return 2
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if overrides:
        config = _write_config(config, spec, overrides, cfg.run_dir)
    log_path = cfg.run_dir / "serve.log"
    url = f"http://{host}:{port}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": os.environ.get("RAY_USAGE_STATS_ENABLED", "0")}
    serve_bin = str(Path(sys.executable).with_name("serve"))
    with log_path.open("ab") as log:
        proc = subprocess.Popen([serve_bin, "run", str(config)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    out(f"raygent train: run {cfg.run_name!r} from {config} ({cfg.iterations} iterations)")
    out(f"  framework logs: {log_path}   status: curl -s {url}/status")

    stops = {"n": 0}

    def on_signal(signum, _frame) -> None:
        stops["n"] += 1
        if stops["n"] == 1:
            out("stopping: the running iteration finishes and a checkpoint is written (again to quit at once)")
            try:
                _request(f"{url}/stop", "POST")
            except (OSError, urllib.error.URLError):
                pass

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _follow(proc, url, out, stops, log_path)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(proc)
    if status is None:
        out(f"raygent train: serve run ended before the run did; see {log_path}:")
        out("\n".join(log_path.read_text(errors="replace").splitlines()[-20:]))
        return 1
    phase, checkpoint = status.get("phase"), status.get("last_checkpoint")
    if phase == "failed":
        out(f"run {cfg.run_name} failed: {status.get('error')}\n  details: {log_path}")
        return 1
    out(f"run {cfg.run_name} {phase} after {status.get('iteration')} iterations; checkpoint: {checkpoint}")
    if checkpoint:
        out(f"serve it:  serve run app.agent:build_agent_app model={checkpoint}/model")
        out(f"evaluate:  raygent eval --checkpoint {checkpoint}/model")
    return 0


def _dashboard(log_path: Path) -> str | None:
    """The Ray dashboard's address, as `serve run` logged it when it started the cluster."""
    match = re.search(r"View the dashboard at \S*?(http://[\w.:]+)", log_path.read_text(errors="replace"))
    return match.group(1) if match else None


def _follow(proc: subprocess.Popen, url: str, out, stops: dict[str, int], log_path: Path) -> dict[str, Any] | None:
    started, last_note, seen, phase, dashboard = time.time(), 0.0, 0, None, None
    status: dict[str, Any] = {}
    while True:
        if dashboard is None and (dashboard := _dashboard(log_path)):
            out(f"  Ray dashboard: {dashboard} (its API wants the cluster's token: ray get-auth-token)")
        if stops["n"] >= 2 or proc.poll() is not None:
            return status if status.get("phase") in FINAL else None
        try:
            status = _request(f"{url}/status")
            for record in _request(f"{url}/metrics/history?since={seen}"):
                seen += 1
                line = _line(record)
                if line:
                    out(line)
        except (OSError, urllib.error.URLError, ValueError):
            if time.time() - last_note > 30:  # Ray, Serve and the policy replicas take a while to come up
                out(f"starting ({time.time() - started:.0f}s): Ray, Serve, the policy replicas ...")
                last_note = time.time()
            time.sleep(2.0)
            continue
        if status.get("phase") != phase:
            phase = status.get("phase")
            if phase in MAJOR_PHASES:  # the steps inside an iteration (rollout, learning, ...) get no line
                out(f"phase: {MAJOR_PHASES[phase]}")
        if phase in FINAL:
            return status
        time.sleep(2.0)


def _stop(proc: subprocess.Popen) -> None:
    """End `serve run`: SIGTERM stops it and the local Ray cluster it started; what is left after a minute is killed
    with its process group."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
