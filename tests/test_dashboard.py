"""The Grafana dashboard shipped in docs/grafana/ is the one the code builds, and names only gauges the run exports
(the end-to-end test scrapes them from Ray's metrics agent during a real run)."""

from __future__ import annotations

import json
import re

from actors.metrics import DASHBOARD_METRICS, grafana_dashboard, prometheus_name
from tests.conftest import REPO


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
