"""The documentation: the site builds strictly (a broken link, a page outside the nav or a missing one fails it),
the configuration reference is what the schema renders, and every link of the README resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_the_docs_build_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "configuration" / "index.html").is_file()


def test_the_configuration_reference_is_current():
    from app.config_reference import PAGE, render

    assert PAGE.read_text() == render(), "docs/configuration.md is stale: run python -m app.config_reference"


def test_the_configuration_reference_names_every_field():
    from actors.config import TrainConfig
    from app.config_reference import render

    page = render()
    for section in ("policy", "rollout", "optim", "checkpoint", "weight_sync", "placement"):
        fields = TrainConfig.model_fields[section].annotation.model_fields
        for name in fields:
            if not hasattr(fields[name].annotation, "model_fields"):
                assert f"`{section}.{name}`" in page, f"{section}.{name}"


def test_every_link_in_the_readme_resolves():
    readme = (REPO / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    assert links, "the README links its docs pages"
    missing = [t for t in links if not (REPO / t).exists()]
    assert not missing, missing
