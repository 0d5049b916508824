"""Where a run's metrics go: a JSONL file in the run folder (always readable), the Ray dashboard through
`ray.util.metrics`, and optionally W&B (offline unless a key is set) and MLflow."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("raygent")

# Exported through Ray's metrics agent (Prometheus: ray_raygent_<key with / as _>{run="<run name>"}) and drawn by
# the Grafana dashboard `grafana_dashboard()` builds (docs/grafana/raygent.json): (key, help, panel group).
DASHBOARD_METRICS = {
    "train/success_rate": ("share of training episodes won", "learning"),
    "val/success_rate": ("held-out success rate", "learning"),
    "train/return": ("mean episode return", "learning"),
    "train/episode_length": ("mean episode length (steps)", "learning"),
    "train/valid_action_ratio": ("share of steps whose reply parsed into an admissible action", "learning"),
    "train/loss": ("the update's loss", "update"),
    "train/approx_kl": ("approx KL(old || new) of the update (k3)", "update"),
    "train/kl": ("KL to the reference policy", "update"),
    "train/entropy": ("token entropy", "update"),
    "train/clip_frac": ("share of tokens clipped", "update"),
    "train/grad_norm": ("gradient norm before clipping", "update"),
    "train/rollout_trainer_logprob_gap": ("mean |engine - trainer| behaviour log-prob", "update"),
    "perf/env_steps_per_s": ("env steps per second during rollout", "speed"),
    "perf/tokens_per_s": ("generated tokens per second during rollout", "speed"),
    "time/iteration_s": ("seconds per iteration", "speed"),
    "time/generate_s": ("seconds of the rollout waiting on the policy", "speed"),
    "time/train_s": ("seconds of the Train job's update", "speed"),
    "time/broadcast_s": ("seconds to broadcast new weights", "speed"),
    "perf/overlap_share": ("share of the update a rollout ran beside (async mode)", "speed"),
    "perf/policy_replicas": ("Policy replicas that answered the sync check before the rollout", "speed"),
    "perf/replicas_answering": ("Policy replicas that answered the rollout's requests", "speed"),
    "perf/replicas_updated": ("Policy replicas that took the new weights after the update", "speed"),
    "train/staleness_max": ("the most weight versions a trained row lagged (async mode: <= max_staleness)",
                            "update"),
    "train/too_stale_rows": ("rows left out of the loss: older than max_staleness", "faults"),
    "weight_version": ("policy weight version", "faults"),
    "faults/rerolled_groups": ("groups re-rolled after an env-group actor failed", "faults"),
    "faults/dropped_groups": ("groups dropped after a second failure", "faults"),
    "faults/prompt_too_long": ("episodes ended by a prompt longer than max_model_len", "faults"),
    "train/token_budget_endings": ("conversations ended by rollout.conversation_tokens (conversation mode)",
                                   "learning"),
    "train/gateway_merged_share": ("trajectories of a user's agent whose calls merged into one row (the gateway)",
                                   "learning"),
    "faults/agent_errors": ("trajectories of a user's agent that raised", "faults"),
    "faults/agent_timeouts": ("trajectories of a user's agent past agent.timeout_s", "faults"),
    "faults/agent_no_calls": ("trajectories of a user's agent that never called the model", "faults"),
    "faults/env_errors": ("failures of services an env depends on (retriever, tools)", "faults"),
    "faults/stale_rows": ("rows from a replica on other weights (their groups are dropped)", "faults"),
    "faults/trainer_restarts": ("Train job restarts from the last checkpoint", "faults"),
    "faults/checkpoint_failures": ("checkpoints the disk refused (the last one stays)", "faults"),
    "faults/storage_failures": ("checkpoints checkpoint.storage refused (they stay in the run folder)", "faults"),
}


GAUGE_REFRESH_S = 5.0


def prometheus_name(key: str) -> str:
    """What Ray's metrics agent calls the gauge of a metrics key."""
    return "ray_raygent_" + key.replace("/", "_")


class MetricsSink:
    """`resume_iteration`: the iteration of the checkpoint a run resumes from. The records after it (iterations that
    ran but were not checkpointed before a crash) are cut, so the resumed run's history has each iteration once; W&B
    and MLflow continue the same run (their ids are kept in the run folder)."""

    def __init__(self, run_dir: Path, run_name: str, logging_cfg: Any, config: dict[str, Any],
                 resume_iteration: int | None):
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.cfg = logging_cfg
        self.run_name = run_name
        self.records: list[dict[str, Any]] = []
        if resume_iteration is not None and self.path.exists():
            kept = [r for r in (json.loads(line) for line in self.path.read_text().splitlines() if line.strip())
                    if int(r.get("iteration", 0)) <= resume_iteration]
            self.records = kept
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        elif self.path.exists():
            self.path.unlink()
        resume = resume_iteration is not None
        self._gauges = self._make_gauges()
        self._last: dict[str, float] = {}  # the last value of each gauge, re-set by the refresher
        self._lock = threading.Lock()
        if self._gauges:
            threading.Thread(target=self._refresh_gauges, name="raygent-gauges", daemon=True).start()
        self._wandb = self._start_wandb(config, run_dir, resume) if logging_cfg.wandb else None
        self._mlflow = self._start_mlflow(config, resume) if logging_cfg.mlflow else None

    def _run_id(self, tracker: str, resume: bool, new: Any) -> str:
        """The tracker's run id for this run folder: the kept one when resuming, else a new one (kept)."""
        path = self.run_dir / f"{tracker}_run_id"
        if resume and path.exists():
            return path.read_text().strip()
        run_id = str(new())
        path.write_text(run_id)
        return run_id

    def _make_gauges(self) -> dict[str, Any]:
        try:
            from ray.util.metrics import Gauge
        except ImportError:  # outside Ray
            return {}
        return {k: Gauge(prometheus_name(k).removeprefix("ray_"), description=d, tag_keys=("run",))
                for k, (d, _) in DASHBOARD_METRICS.items()}

    def _refresh_gauges(self) -> None:
        """Re-set every gauge to its last value every few seconds, for as long as the process lives. Ray 2.60 exports
        metrics through OpenTelemetry, whose recorder drops a gauge not set again within two report intervals
        (~20 s): an iteration longer than that, an idle or finished run, would vanish from Prometheus and Grafana."""
        tags = {"run": self.run_name}
        while True:
            time.sleep(GAUGE_REFRESH_S)
            with self._lock:
                last = dict(self._last)
            for key, value in last.items():
                self._gauges[key].set(value, tags=tags)

    def _start_wandb(self, config: dict[str, Any], run_dir: Path, resume: bool):
        import wandb

        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        run_id = self._run_id("wandb", resume, wandb.util.generate_id)
        return wandb.init(project=self.cfg.wandb_project, name=self.run_name, config=config, dir=str(run_dir),
                          mode=mode, id=run_id, resume="allow")

    def _start_mlflow(self, config: dict[str, Any], resume: bool):
        import mlflow

        if self.cfg.mlflow_tracking_uri:
            mlflow.set_tracking_uri(self.cfg.mlflow_tracking_uri)
        mlflow.set_experiment("raygent")
        path = self.run_dir / "mlflow_run_id"
        if resume and path.exists():
            return mlflow.start_run(run_id=path.read_text().strip())
        run = mlflow.start_run(run_name=self.run_name)
        path.write_text(run.info.run_id)
        mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})
        return run

    def truncate(self, iteration: int) -> None:
        """Forget the records after `iteration` (a restart from its checkpoint redoes them)."""
        self.records = [r for r in self.records if int(r.get("iteration", 0)) <= iteration]
        if self.cfg.jsonl:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            os.replace(tmp, self.path)

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.cfg.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        for key, gauge in self._gauges.items():
            if isinstance(record.get(key), (int, float)):
                gauge.set(float(record[key]), tags={"run": self.run_name})
                with self._lock:
                    self._last[key] = float(record[key])
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        step = int(record.get("iteration", len(self.records)))
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("/", "_"): v for k, v in numeric.items()}, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


FRAMEWORK_LOGGERS = ("ray.train", "ray.data", "ray.tune", "transformers", "vllm", "filelock", "urllib3")


def console_logger() -> logging.Logger:
    """The run's console: the "raygent" logger, INFO, one "[raygent] ..." line per message on stdout (the `serve run`
    console shows it)."""
    logger = logging.getLogger("raygent")
    if not any(getattr(h, "_raygent", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[raygent] %(message)s"))
        handler._raygent = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def iteration_line(r: dict[str, Any], iterations: int, show_async: bool) -> str:
    """An iteration's record as its console line."""
    val = f" | val success {100 * r['val/success_rate']:.1f}%" if "val/success_rate" in r else ""
    staleness = (f" | staleness max {r.get('train/staleness_max', 0)} overlap "
                 f"{100 * r.get('perf/overlap_share', 0):.0f}%" if show_async else "")
    return (f"iter {r['iteration']}/{iterations} | success {100 * r.get('train/success_rate', 0):.1f}% | return "
            f"{r.get('train/return', 0.0):.2f} | valid {100 * r.get('train/valid_action_ratio', 0):.1f}% | steps/s "
            f"{r.get('perf/env_steps_per_s', 0):.0f} | rollout {r.get('time/rollout_s', 0):.1f}s data "
            f"{r.get('time/dataset_s', 0):.1f}s train {r.get('time/train_s', 0):.1f}s bcast "
            f"{r.get('time/broadcast_s', 0):.2f}s{val}{staleness}")


def quiet_frameworks(level: str = "WARNING") -> None:
    """Framework logs at `level` in this process (Ray Train / Data, transformers, vLLM; progress bars off below
    INFO), so the console shows the run's own lines. `logging.framework_level: INFO` brings them back."""
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", level)  # read when vLLM is first imported
    for name in FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if logging.getLevelName(level) > logging.INFO:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity(logging.getLevelName(level))
            hf_logging.disable_progress_bar()
        except ImportError:
            pass


def grafana_dashboard() -> dict[str, Any]:
    """A Grafana dashboard (JSON model) of the raygent gauges for Ray's Prometheus + Grafana setup: one row per group,
    one time series per metric, a `run` variable over the runs the cluster exported. Committed as
    docs/grafana/raygent.json (a test keeps the two equal)."""
    panels: list[dict[str, Any]] = []
    y = 0
    for group in dict.fromkeys(g for _, g in DASHBOARD_METRICS.values()):
        panels.append({"type": "row", "title": group, "collapsed": False, "id": len(panels) + 1,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        keys = [k for k, (_, g) in DASHBOARD_METRICS.items() if g == group]
        for i, key in enumerate(keys):
            description, _ = DASHBOARD_METRICS[key]
            panels.append({
                "type": "timeseries", "title": key, "description": description, "id": len(panels) + 1,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 7, "w": 8, "x": 8 * (i % 3), "y": y + 7 * (i // 3)},
                "targets": [{"refId": "A", "expr": f'{prometheus_name(key)}{{run=~"$run"}}',
                             "legendFormat": "{{run}}", "datasource": {"type": "prometheus",
                                                                      "uid": "${datasource}"}}],
                "fieldConfig": {"defaults": {"unit": "percentunit" if "rate" in key or "ratio" in key else "none"},
                                "overrides": []}})
        y += 7 * ((len(keys) + 2) // 3)
    return {
        "title": "raygent", "uid": "raygent-run", "tags": ["raygent", "ray"], "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "editable": True, "panels": panels,
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "run", "type": "query", "label": "Run", "multi": True, "includeAll": True,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": f"label_values({prometheus_name('weight_version')}, run)", "refId": "run"},
             "definition": f"label_values({prometheus_name('weight_version')}, run)", "refresh": 2}]},
    }
