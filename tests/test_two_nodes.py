"""Two Ray nodes that share no disk, on one machine: a head node, and a worker node whose `ray start` runs in its own
mount namespace with private tmpfs over its Ray folder, the run's output folder and every cache the project
writes, so a file either node writes is invisible to the other. Storage is reached only through its URI (a local
S3-compatible server). On one cluster, in order: a run without storage is refused before any actor starts; with
storage and no placement, the run (its warm start first) trains and checkpoints to storage; the head's run folder
is deleted and the run resumes from storage with its Train workers and one Policy replica on the worker node
(custom resources, `max_replicas_per_node: 1`) and the controller on the head; the worker node is killed mid-run
and the run goes on once a new node joins; the agent endpoint, its replica on the worker node, serves the trained
checkpoint from storage."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO, free_port
from tests.serve_helpers import SERVE, get_status, wait_for

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


class Node:
    """`ray start --block` of one node in its own mount namespace, `private` folders each under a fresh tmpfs;
    killed by its process group."""

    def __init__(self, args: list[str], private: list[Path], log: Path, env: dict[str, str]):
        mounts = "".join(f"mkdir -p {p} && mount -t tmpfs tmpfs {p} && " for p in private)
        script = mounts + "exec " + shlex.join([RAY, "start", "--block", "--disable-usage-stats", *args])
        self.log = log
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                     cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> None:
        """Every process of the node at once, as a node that dies. Also the teardown: a `ray start` stopped by
        SIGTERM drains its node first, waiting up to 30 s for what still runs there."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


def _ports() -> list[str]:
    """Every port a node binds, chosen free (two nodes on one address must not share the fixed defaults)."""
    low = free_port()
    flags = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    return [x for flag in flags for x in (flag, str(free_port()))] + [
        # below the kernel's ephemeral range (32768-60999), where free_port's picks come from
        "--min-worker-port", str(12000 + low % 7000), "--max-worker-port", str(12000 + low % 7000 + 400)]


class _Driver:  # what wait_for watches: a `serve run` process and its log
    def __init__(self, config: Path, log: Path, env: dict[str, str]):
        self.log = log
        self.proc = subprocess.Popen([SERVE, "run", str(config)], cwd=REPO, env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def two_nodes(tmp_path):
    gcs = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    env.pop("RAY_ADDRESS", None)
    head_tmp, worker_tmp = Path(f"/tmp/rh{gcs}"), Path(f"/tmp/rw{gcs}")
    head = Node(["--head", "--port", str(gcs), "--num-cpus", "3", "--resources", '{"head_node": 100}',
                 "--include-dashboard", "false", "--temp-dir", str(head_tmp), *_ports()],
                [], tmp_path / "head.log", env)
    address = f"127.0.0.1:{gcs}"
    cache = Path(os.environ["RAYGENT_CACHE"])
    private = [worker_tmp, head_tmp, Path("/tmp/ray"), tmp_path / "runs", cache, Path.home() / ".cache" / "raygent"]
    workers: list[Node] = []

    def start_worker() -> Node:
        node = Node(["--address", address, "--num-cpus", "2", "--resources", '{"worker_node": 100}',
                     "--temp-dir", str(worker_tmp), *_ports()], private, tmp_path / f"worker{len(workers)}.log", env)
        workers.append(node)
        return node

    def alive_nodes() -> int:
        out = subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True, timeout=60,
                             env=env).stdout
        return out.split("Active:", 1)[-1].split("Pending:", 1)[0].count("node_")

    try:
        deadline = time.monotonic() + 120
        while alive_nodes() < 1:
            assert time.monotonic() < deadline and head.proc.poll() is None, (tmp_path / "head.log").read_text()
            time.sleep(2)
        start_worker()
        while alive_nodes() < 2:
            assert time.monotonic() < deadline and workers[-1].proc.poll() is None, \
                (tmp_path / "worker0.log").read_text()
            time.sleep(2)
        yield {"address": address, "env": {**env, "RAY_ADDRESS": address}, "start_worker": start_worker,
               "workers": workers, "alive_nodes": alive_nodes}
    finally:
        for node in [*workers, head]:
            node.kill()


def _train_config(tmp_path: Path, name: str, port: int, storage: str | None, iterations: int,
                  placed: bool = True) -> Path:
    """test_tiny (its warm start on) with `storage`; `placed`: the controller and the ingress on the head, the Train
    workers on the worker node, one Policy replica per node; else wherever Ray puts them."""
    spec = yaml.safe_load((REPO / "serve_configs" / "test_tiny.yaml").read_text())
    spec["http_options"]["port"] = port
    app = spec["applications"][0]
    # The nodes, their disks and storage are the subject: the replicas answer with transformers (`engine: hf`,
    # started in seconds where vLLM takes ~30 on these cores; vLLM runs in every run of test_train_e2e.py).
    app["args"].update(output_dir=str(tmp_path / "runs"), run_name="two-nodes", iterations=iterations,
                       policy={**app["args"]["policy"], "engine": "hf"},
                       checkpoint={"every": 1, "keep": 2, "resume": "auto", "storage": storage},
                       warm_start={**app["args"]["warm_start"], "steps": 4, "eval_every": 4})  # its path only
    if placed:
        app["args"]["placement"] = {"controller": {"head_node": 1}, "trainer": {"worker_node": 1}}
        app["deployments"] = [
            {"name": "Policy", "num_replicas": 2, "max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0.25}},
            {"name": "TrainingRun", "ray_actor_options": {"num_cpus": 0, "resources": {"head_node": 1}}}]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _processes(title: str, since: float) -> list[int]:
    """Processes (of either node: they share this machine) whose title starts with `title`, started after `since`."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline", "create_time"])
            if " ".join(p.info["cmdline"] or []).startswith(title) and p.info["create_time"] >= since]


def _run_to_the_end(config: Path, log: Path, env: dict[str, str], url: str, timeout: float) -> dict:
    driver = _Driver(config, log, env)
    try:
        return wait_for(lambda: (s := get_status(url))["done"] and s, timeout, f"{config.name} to finish", driver)
    finally:
        driver.stop()


@pytest.mark.timeout(900)
def test_a_run_on_two_nodes_without_a_shared_disk_trains_resumes_from_storage_and_serves(two_nodes, tmp_path,
                                                                                         s3_bucket):
    import shutil

    from actors.storage import Storage

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    storage = s3_bucket.format(key="two-nodes")
    stored = Storage(s3_bucket.format(key="two-nodes/two-nodes"))

    # Without storage (and no shared disk declared) the run cannot keep its files where every node reads them: it
    # is refused while Serve builds the app, before any actor starts, naming the setting.
    started = time.time()
    driver = _Driver(_train_config(tmp_path, "nostorage", port, None, 2, placed=False), tmp_path / "nostorage.log",
                     two_nodes["env"])
    try:
        wait_for(lambda: (tmp_path / "nostorage.log").read_text().count("this Ray cluster has 2 nodes"), 120,
                 "the refusal", driver)
    finally:
        driver.stop()
    log = (tmp_path / "nostorage.log").read_text()
    assert "args.checkpoint.storage: this Ray cluster has 2 nodes and the run has no storage" in log, log[-3000:]
    assert "checkpoint.shared_disk" in log
    assert not [p for p in ("ray::Controller", "ray::ServeReplica:train:Policy", "ray::RayTrainWorker")
                if _processes(p, started)], "an actor of the refused run started"
    assert not (tmp_path / "runs" / "two-nodes" / "checkpoints").exists()

    # With storage, on the same cluster, no placement (Ray puts the actors and replicas where it likes): the warm
    # start, two iterations, each checkpoint in storage.
    status = _run_to_the_end(_train_config(tmp_path, "train2", port, storage, 2, placed=False),
                             tmp_path / "train2.log", two_nodes["env"], url, 600)
    assert status["phase"] == "done" and status["iteration"] == 2, status
    assert stored.folders("checkpoints") == ["iter_000001", "iter_000002"]
    assert stored.exists("checkpoints/iter_000002/train_state/.metadata")
    assert stored.exists("reference/model.safetensors")  # the warm start's policy, the KL reference
    assert not stored.folders("staging")

    # The head's run folder is gone too: only storage has the run. It resumes from there, and mid-run the worker
    # node (its Train workers, a Policy replica, maybe env-group actors) is killed: the Train job is started again
    # from the last checkpoint once a new node with the workers' resources joins, and the run goes on to its end.
    shutil.rmtree(tmp_path / "runs")
    driver = _Driver(_train_config(tmp_path, "train4", port, storage, 4), tmp_path / "train4.log", two_nodes["env"])
    try:
        wait_for(lambda: stored.exists("checkpoints/iter_000003/.complete"), 900, "the checkpoint of iteration 3",
                 driver)
        two_nodes["workers"][-1].kill()
        wait_for(lambda: two_nodes["alive_nodes"]() == 1, 120, "the worker node to be gone", driver)
        # the run notices: its Train job is lost, and the new one waits for a node with the workers' resources
        wait_for(lambda: "the Train job failed" in (tmp_path / "train4.log").read_text(), 300,
                 "the run to notice the lost Train job", driver)
        assert not get_status(url)["done"]
        two_nodes["start_worker"]()
        status = wait_for(lambda: (s := get_status(url))["done"] and s, 900, "the run to finish", driver)
    finally:
        driver.stop()
    assert status["phase"] == "done" and status["iteration"] == 4, status
    log = (tmp_path / "train4.log").read_text()
    assert "fetched iter_000002" in log, log[-3000:]
    # the shards of the ranks on the worker node came through storage into the head's checkpoint
    assert stored.exists("checkpoints/iter_000004/train_state/__1_0.distcp")
    assert not stored.folders("staging")
    history = [json.loads(line) for line in stored.read_text("metrics.jsonl").splitlines() if line.strip()]
    trained = [r["iteration"] for r in history if r.get("phase") == "train"]
    assert trained == [1, 2, 3, 4], trained  # a redone iteration replaces its first record
    faults = [r for r in history if r.get("phase") == "fault"]
    assert faults and faults[-1]["faults/trainer_restarts"] >= 1, faults
    assert all(r["faults/storage_failures"] == 0 for r in history if r.get("phase") == "train")
    # the empty run folder got the checkpoint, the KL reference and the history from storage; rotation (keep 2,
    # the checkpoint resumed from pinned) applies there as in the run folder
    runs = tmp_path / "runs" / "two-nodes"
    state = json.loads((runs / "checkpoints" / "iter_000004" / "state.json").read_text())
    assert state["reference_model"] == "reference" and (runs / "reference" / "model.safetensors").exists()
    kept = sorted(p.name for p in (runs / "checkpoints").iterdir() if p.name.startswith("iter_"))
    assert kept == ["iter_000002", "iter_000003", "iter_000004"], kept
    assert stored.folders("checkpoints") == kept

    # The agent endpoint serves the checkpoint from storage, its replica on the worker node.
    agent = yaml.safe_load((REPO / "serve_configs" / "agent.yaml").read_text())
    agent["http_options"]["port"] = port
    app = agent["applications"][0]
    app["args"]["policy"].update(model=stored.uri_of("checkpoints/iter_000004/model"), engine="hf")
    app["deployments"][0]["ray_actor_options"]["resources"] = {"worker_node": 1}
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(agent))
    driver = _Driver(config, tmp_path / "agent.log", two_nodes["env"])
    try:
        card = wait_for(lambda: (a := httpx.get(f"{url}/v1/agent", timeout=10).json()).get("card") and a, 600,
                        "the agent endpoint", driver)
        assert card["card"]["source"]["iteration"] == 4 and card["allowed_envs"] == ["sokoban"], card
        reply = httpx.post(f"{url}/v1/episodes", json={"seed": 3, "sampling_seed": 11}, timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["trajectory"], reply.json()
    finally:
        driver.stop()
