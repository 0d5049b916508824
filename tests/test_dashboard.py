"""The Grafana dashboard shipped in docs/grafana/ is the one the code builds, and names only gauges the run exports
(the end-to-end test scrapes them from Ray's metrics agent during a real run)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from actors.metrics import DASHBOARD_METRICS, grafana_dashboard, prometheus_name
from tests.conftest import REPO, scrape_metrics


def test_committed_dashboard_is_the_generated_one():
    committed = json.loads((REPO / "docs" / "grafana" / "raygent.json").read_text())
    assert committed == grafana_dashboard(), "regenerate: python -c 'import json; from actors.metrics import " \
                                             "grafana_dashboard; print(json.dumps(grafana_dashboard(), indent=1))'"


def test_dashboard_names_only_exported_gauges():
    text = json.dumps(grafana_dashboard())
    used = set(re.findall(r"ray_raygent_\w+", text))
    exported = {prometheus_name(k) for k in DASHBOARD_METRICS}
    assert used == exported
    panels = [p for p in grafana_dashboard()["panels"] if p["type"] == "timeseries"]
    assert len(panels) == len(DASHBOARD_METRICS)


@pytest.fixture(scope="session")
def idle_run_gauge(ray_cluster, tmp_path_factory):
    """A run that logged one record and then fell silent: its gauge's Prometheus name and when it was set."""
    import ray

    from actors.config import LoggingConfig
    from actors.metrics import MetricsSink

    @ray.remote(num_cpus=0)
    class Sink:
        def __init__(self, run_dir: str):
            self.sink = MetricsSink(Path(run_dir), "idle-run", LoggingConfig(jsonl=False), {}, None)

        def log(self, record: dict) -> None:
            self.sink.log(record)

    sink = Sink.remote(str(tmp_path_factory.mktemp("idle-run")))
    ray.get(sink.log.remote({"iteration": 1, "weight_version": 7.0}), timeout=60)
    yield prometheus_name("weight_version"), time.monotonic()
    ray.kill(sink)


def test_a_run_gauge_reaches_the_export_port(idle_run_gauge):
    name, _ = idle_run_gauge
    assert name in scrape_metrics(until={name}, timeout=30, run="idle-run"), "the gauge never reached the export port"


def test_gauges_stay_exported_while_the_run_is_idle(idle_run_gauge):
    """Ray's OpenTelemetry recorder drops a gauge that is not set again within two report intervals (~20 s): a
    run's last values must still be on the export port long after its last record (a long iteration, a finished
    run). conftest runs this test late in the session, so the wait past the eviction has passed meanwhile."""
    name, logged = idle_run_gauge
    time.sleep(max(0.0, logged + 45 - time.monotonic()))  # past the recorder's eviction of a gauge set once
    assert name in scrape_metrics(until={name}, timeout=15, run="idle-run"), \
        "the gauge vanished once the run stopped logging"
