"""One Ray cluster (and one Serve instance) per test session: start-up costs seconds, so tests share it."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Quiet, reproducible, and no writes to the user's home: everything the tests build goes to one session folder.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYGENT_CACHE", str(Path(tempfile.gettempdir()) / f"raygent-test-cache-{os.getuid()}"))
# Serve names the resources of replicas it cannot place once they have waited this long, and first looks that long
# after a deployment starts (30 s each by default): the test of replicas that fit no node then fails its run sooner.
# The cluster's processes inherit them from this one.
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", "5")
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S", "5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(until: set[str] = frozenset(), timeout: float = 0.0, run: str | None = None) -> set[str]:
    """Metric names on the cluster's Ray metrics export ports (Prometheus text format); with `run`, only the series
    of that run. With `until`: scraped again (Ray exports every ~10 s) until all of those names are there or
    `timeout` seconds have passed."""
    import httpx
    import ray

    deadline = time.monotonic() + timeout
    while True:
        names: set[str] = set()
        for node in ray.nodes():
            if node["Alive"] and node.get("MetricsExportPort"):
                text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                                 timeout=10).text
                names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                          if line and line[0] != "#" and (run is None or f'run="{run}"' in line)}
        if until <= names or time.monotonic() > deadline:
            return names
        time.sleep(2.0)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Logical CPUs above the 2 real cores: replicas, env actors and train workers mostly wait on each other.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {k: os.environ[k] for k in ("RAYGENT_CACHE", "TOKENIZERS_PARALLELISM")}})
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_cluster) -> str:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


# A ChatML template that reads `tools=` (as Qwen2.5's and Hermes' do; neither built-in model's does), written here to
# test the native path: the schemas in the system turn, `tool` turns as their own role, an assistant's tool calls as
# <tool_call> blocks. (transformers renders with trim_blocks: a newline right after a tag is written as {{ '\n' }}.)
TOOLS_TEMPLATE = (
    "{% if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{{ '\\nTools you may call:' }}{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def load_tokenizer(name: str):
    """A built-in model's tokenizer; "smollm2-135m+tools": SmolLM2's with TOOLS_TEMPLATE."""
    from transformers import AutoTokenizer

    from app.default_model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name.removesuffix("+tools")))
    if name.endswith("+tools"):
        tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def default_model() -> str:
    from app.default_model import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """A bucket on a local S3-compatible server (moto's server mode, stopped by its PID): the URI prefix of a
    storage folder, credentials and endpoint in the URI, so Ray's workers need no environment of their own."""
    import subprocess

    import pyarrow.fs

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        query = f"?endpoint_override=127.0.0.1:{port}&scheme=http"
        fs, _ = pyarrow.fs.FileSystem.from_uri(f"s3://test:test@raygent/{query}&allow_bucket_creation=true")
        fs.create_dir("raygent")
        yield f"s3://test:test@raygent/{{key}}{query}"
    finally:
        server.kill()
        server.wait(timeout=30)


# Modules whose tests start `serve run` as a subprocess, in the order they run, after every other test: a `serve
# run` replaces the session's Serve apps and shuts Serve down when it exits.
SERVE_RUN_MODULES = ("test_train_e2e", "test_train_envs")
# Tests that wait for time to pass (a gauge that must outlive an eviction interval): they run after the other tests
# that share the cluster, and their fixtures start early (an earlier test of their module asks for them), so the
# wait has passed by then.
LATE_TESTS = ("test_gauges_stay_exported_while_the_run_is_idle",)


def pytest_collection_modifyitems(config, items):
    """LATE_TESTS after the rest, then the `serve run` tests (SERVE_RUN_MODULES); the sort is stable, so each
    module keeps its own order."""

    def rank(item) -> float:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        if module in SERVE_RUN_MODULES:
            return SERVE_RUN_MODULES.index(module) + 1
        return 0.5 if item.name in LATE_TESTS else 0

    items.sort(key=rank)
