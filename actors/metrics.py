"""Where a run's metrics go: a JSONL file in the run folder (always readable), the Ray dashboard through
`ray.util.metrics`, and optionally W&B (offline unless a key is set) and MLflow."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("raygent")

# Shown on the Ray dashboard (Grafana) as gauges tagged with the run name.
DASHBOARD_METRICS = {
    "train/success_rate": "share of training episodes won",
    "train/return": "mean episode return",
    "train/episode_length": "mean episode length (steps)",
    "train/valid_action_ratio": "share of steps whose reply parsed into an admissible action",
    "val/success_rate": "held-out success rate",
    "perf/env_steps_per_s": "env steps per second during rollout",
    "perf/tokens_per_s": "generated tokens per second during rollout",
    "train/loss": "policy loss", "train/kl": "KL to the reference policy", "train/entropy": "token entropy",
    "weight_version": "policy weight version", "time/broadcast_s": "seconds to broadcast new weights",
}


class MetricsSink:
    def __init__(self, run_dir: Path, run_name: str, logging_cfg: Any, config: dict[str, Any], resume: bool):
        self.path = run_dir / "metrics.jsonl"
        self.cfg = logging_cfg
        self.run_name = run_name
        self.records: list[dict[str, Any]] = []
        if resume and self.path.exists():
            self.records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        elif self.path.exists():
            self.path.unlink()
        self._gauges = self._make_gauges()
        self._wandb = self._start_wandb(config, run_dir) if logging_cfg.wandb else None
        self._mlflow = self._start_mlflow(config) if logging_cfg.mlflow else None

    def _make_gauges(self) -> dict[str, Any]:
        try:
            from ray.util.metrics import Gauge
        except ImportError:  # outside Ray
            return {}
        return {k: Gauge("raygent_" + k.replace("/", "_"), description=d, tag_keys=("run",))
                for k, d in DASHBOARD_METRICS.items()}

    def _start_wandb(self, config: dict[str, Any], run_dir: Path):
        import wandb

        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        return wandb.init(project=self.cfg.wandb_project, name=self.run_name, config=config, dir=str(run_dir),
                          mode=mode, resume="allow")

    def _start_mlflow(self, config: dict[str, Any]):
        import mlflow

        if self.cfg.mlflow_tracking_uri:
            mlflow.set_tracking_uri(self.cfg.mlflow_tracking_uri)
        mlflow.set_experiment("raygent")
        run = mlflow.start_run(run_name=self.run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})
        return run

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.cfg.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        for key, gauge in self._gauges.items():
            if isinstance(record.get(key), (int, float)):
                gauge.set(float(record[key]), tags={"run": self.run_name})
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
