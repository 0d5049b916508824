"""`serve run` of a Serve config as a user runs it (its own local Ray cluster, a free port), for the benchmarks that
drive an endpoint from outside."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_run(spec: dict[str, Any], work: Path, ready_route: str, timeout_s: float = 600) -> Iterator[str]:
    """Write `spec` (a Serve config; its HTTP port replaced by a free one) under `work`, `serve run` it with the log
    in `work/serve.log`, yield the base URL once GET `ready_route` answers 200, and stop it afterwards (SIGTERM,
    then SIGKILL of its process group: `serve run` can take minutes to shut down)."""
    import httpx

    port = free_port()
    spec = {**spec, "http_options": {**spec.get("http_options", {}), "host": "127.0.0.1", "port": port}}
    config, log = work / "serve_config.yaml", work / "serve.log"
    config.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config)], cwd=REPO_ROOT,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve run exited; see {log}")
            try:
                if httpx.get(f"{url}{ready_route}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - started > timeout_s:
                raise SystemExit(f"the endpoint did not come up in {timeout_s:.0f} s; see {log}")
            time.sleep(2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
