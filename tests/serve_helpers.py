"""Helpers for the tests that run a Serve config as a user does: `serve run CONFIG` as a subprocess on the session's
Ray cluster, polled over HTTP. Such tests run last (conftest): `serve run` shuts Serve down when it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import REPO

SERVE = str(Path(sys.executable).with_name("serve"))


class ServeRun:
    """`serve run CONFIG` in the background, from the repo root (serve run puts it on the import path)."""

    def __init__(self, config: Path, log: Path, address: str):
        env = {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        self.log = log
        self.proc = subprocess.Popen([SERVE, "run", str(config)], cwd=REPO, env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a backgrounded serve run ignores SIGINT
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_for(predicate, timeout: float, what: str, run: ServeRun, interval: float = 1.0):
    """`predicate()`'s first truthy value, polled every `interval` seconds; fails the test when the run exits or
    `timeout` seconds pass first (with the end of its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            pytest.fail(f"serve run exited ({run.proc.returncode}) while waiting for {what}:\n"
                        + run.log.read_text()[-3000:])
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(interval)
    pytest.fail(f"timed out waiting for {what}:\n" + run.log.read_text()[-3000:])


def get_status(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=5).json()


def get_history(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/metrics/history", timeout=5).json()


def training_config(source: Path, dest: Path, port: int, output_dir: Path, **args: Any) -> Path:
    """A copy of the training Serve config `source` at `dest` that binds `port` (the session's Serve port: the
    cluster's one Serve instance keeps the port it started with), writes its run under `output_dir`, and has the
    top-level `args` fields given (e.g. iterations=2)."""
    spec = yaml.safe_load(source.read_text())
    spec["http_options"]["port"] = port
    app_args = spec["applications"][0]["args"]
    app_args["output_dir"] = str(output_dir)
    app_args.update(args)
    dest.write_text(yaml.safe_dump(spec))
    return dest
