"""The Train job's supervision on the session's Ray cluster, without Serve: a warm-start task whose rank is stopped
(SIGSTOP: alive, silent) ends within trainer.stall_timeout_s with a message naming the phase and what each rank was
doing, and the job's workers and placement group are gone after it; a placement group that a dead controller's
Train job left behind is removed by the run's next job; the controller's waits on Ray Data end when no CPU is free
for its tasks. A path a node lacks is never taken for a hub id."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # a real Ray Train job


def _config(tmp_path: Path, **trainer):
    from actors.config import TrainConfig

    spec = yaml.safe_load((REPO / "serve_configs" / "test_tiny.yaml").read_text())["applications"][0]["args"]
    return TrainConfig.model_validate({**spec, "run_name": "stall-test", "output_dir": str(tmp_path / "runs"),
                                       "trainer": {**spec["trainer"], **trainer}})


def _worker_pids() -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"])
            if " ".join(p.info["cmdline"] or []).startswith("ray::RayTrainWorker")]


def test_a_stopped_rank_ends_the_warm_start_task_within_the_stall_deadline(ray_cluster, default_model, tmp_path):
    import ray
    from ray.experimental.internal_kv import _internal_kv_get

    from actors.batch import split_for_workers
    from actors.supervisor import TrainJobSupervisor
    from actors.trainer import PG_KEY_PREFIX, TrainerFailure

    cfg = _config(tmp_path, stall_timeout_s=10, task_timeout_s=600)
    supervisor = TrainJobSupervisor(cfg, cfg.run_dir, None, default_model, default_model)
    supervisor.start(None, default_model)
    job = supervisor.job
    rows = [{"prompt_ids": [3, 4, 5, 6] * 8, "response_ids": [7, 8, 1]} for _ in range(64)]
    shards = split_for_workers(ray.data.from_items(rows).materialize(), cfg.trainer.num_workers)

    async def warm_start():
        first = await job.run({"kind": "sft", "shards": shards, "steps": 2, "batch_size": 8, "lr": 1e-3})
        assert first[0]["metrics"]["sft_loss"] > 0  # the job works: then one of its ranks stops answering
        recorded.append(_internal_kv_get(f"{PG_KEY_PREFIX}{job.job_key}", namespace="raygent").decode())
        (stopped, *_) = _worker_pids()
        os.kill(stopped, signal.SIGSTOP)
        try:
            with pytest.raises(TrainerFailure) as failure:
                await job.run({"kind": "sft", "shards": None, "steps": 1000, "batch_size": 8, "lr": 1e-3})
        finally:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        return str(failure.value)

    recorded: list[str] = []  # the job's placement group, as its rank 0 recorded it
    message = asyncio.run(asyncio.wait_for(warm_start(), 300))
    assert "made no progress for 10s during the warm start (task 'sft')" in message, message
    assert "rank 0 was" in message and "rank 1 was" in message, message
    # the job is ended: no worker left (killing a process is asynchronous: a few seconds), its placement group removed
    deadline = time.monotonic() + 30
    while _worker_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _worker_pids()
    assert ray.util.placement_group_table()[recorded[0]]["state"] == "REMOVED"


def test_a_placement_group_left_by_a_dead_controller_goes_with_the_runs_next_job(ray_cluster, default_model,
                                                                                 tmp_path):
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from actors.supervisor import TrainJobSupervisor
    from actors.trainer import record_placement_group

    leaked = placement_group([{"CPU": 0.1}])
    ray.get(leaked.ready(), timeout=60)
    record_placement_group("stall-test/dead-job", leaked.id.hex())
    other = placement_group([{"CPU": 0.1}])  # another run's: left alone
    ray.get(other.ready(), timeout=60)
    record_placement_group("stall-test-2/job", other.id.hex())
    TrainJobSupervisor(_config(tmp_path), tmp_path / "runs" / "stall-test", None, default_model, default_model)
    assert placement_group_table(leaked)["state"] == "REMOVED"
    assert placement_group_table(other)["state"] == "CREATED"
    ray.util.remove_placement_group(other)


def test_a_dataset_whose_tasks_find_no_free_cpu_ends_the_wait_naming_it(ray_cluster, caplog):
    """Ray Data's metadata and split tasks each need a whole CPU: with less than one free (here an actor holds the
    rest), building the warm start's dataset would wait forever. The wait says so, then fails naming what it waited
    for; once a CPU is free the same build goes through."""
    import pyarrow as pa
    import ray

    from actors.batch import built_within, split_for_workers

    @ray.remote
    class Hog:
        def ready(self) -> bool:
            return True

    hog = Hog.options(num_cpus=ray.available_resources()["CPU"] - 0.5).remote()
    ray.get(hog.ready.remote(), timeout=60)
    tables = [ray.put(pa.table({"prompt_ids": [[1, 2]] * 3})) for _ in range(2)]

    def build():
        return split_for_workers(ray.data.from_arrow_refs(tables).materialize(), 2)

    # A loop of its own, closed without joining its threads (asyncio.run would wait for the stuck build's thread,
    # as the controller's long-lived loop never does): the build goes on in the background until the hog is gone.
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError) as e:
            loop.run_until_complete(built_within(6, "the warm start's demonstration dataset", build))
    finally:
        ray.kill(hog)
        loop.close()
    assert "the warm start's demonstration dataset was not built within 6s" in str(e.value)
    assert re.search(r"\(0\.\d\d of the cluster's \d+ CPUs are free\)", str(e.value)), str(e.value)
    assert any("still waiting after 3s" in r.getMessage() for r in caplog.records)
    shards = asyncio.run(built_within(60, "the same dataset", build))
    assert [s.count() for s in shards] == [3, 3]


def test_a_path_this_node_lacks_is_named_not_taken_for_a_hub_id(tmp_path):
    from actors.storage import local_folder
    from app.default_model import resolve_model

    for path in (str(tmp_path / "gone" / "model"), "./runs/gone/checkpoints/iter_000001/model", "~/gone/model"):
        for load in (local_folder, resolve_model):
            with pytest.raises(FileNotFoundError) as e:
                load(path)
            message = str(e.value)
            assert path in message and "does not exist on node" in message, message
            assert "args.checkpoint.storage" in message and "checkpoint.shared_disk" in message, message
    assert resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"  # a hub id stays one
    assert local_folder(str(tmp_path)) == str(tmp_path)
