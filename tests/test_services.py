"""The controller's services on their own, without a Ray cluster: the weight version and its transfers
(actors/weight_sync.py), the spread of work over env-group actors with their failures (actors/rollouts.py), when
and where checkpoints go (actors/checkpointer.py) and the Train job's restarts (actors/supervisor.py). Their
collaborators (the Policy deployment's handle, a Train job, env-group actors) are small stand-ins that behave as
those do at the edges these tests need; the end-to-end tests (test_train_e2e.py) drive the real ones."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray.exceptions
import yaml

from actors.checkpointer import Checkpointer
from actors.config import TrainConfig
from actors.rollouts import EnvGroupPool, rollout_metrics
from actors.supervisor import TrainJobSupervisor
from actors.trainer import TrainerFailure
from actors.weight_sync import GROUP_FAILURES_MAX, WeightSync
from tests.conftest import REPO


def config(tmp_path: Path, **args: Any) -> TrainConfig:
    spec = yaml.safe_load((REPO / "serve_configs" / "test_tiny.yaml").read_text())["applications"][0]["args"]
    return TrainConfig.model_validate({**spec, "output_dir": str(tmp_path / "runs"), **args})


class Replies:
    """What `DeploymentHandle.broadcast(...)` returns: every replica's answer (an exception where it failed)."""

    def __init__(self, answers: list[Any]):
        self.answers = answers

    async def results_async(self, return_exceptions: bool = False) -> list[Any]:
        return self.answers


class PolicyReplicas:
    """The Policy deployment as the controller sees it: replicas with a weight version. `refuse`: replicas whose
    engine refuses object-store updates; `miss_group`: replicas that fail group transfers."""

    def __init__(self, n: int, refuse: tuple[int, ...] = (), miss_group: tuple[int, ...] = ()):
        self.versions = [0] * n
        self.refuse, self.miss_group = set(refuse), set(miss_group)
        self.updates: list[int] = []

    def broadcast(self, method: str, *args: Any) -> Replies:
        answers: list[Any] = []
        for k in range(len(self.versions)):
            if method == "info":
                answers.append({"replica_id": f"r{k}", "version": self.versions[k]})
            elif method == "update_weights":
                if k in self.refuse:
                    answers.append(RuntimeError("the engine refused the weights"))
                    continue
                self.versions[k] = args[1]
                self.updates.append(args[1])
                answers.append({"version": args[1]})
            elif method == "receive_weights":
                if k in self.miss_group:
                    answers.append(RuntimeError("weight group failed: a member is gone"))
                    continue
                self.versions[k] = args[1]
                answers.append({"replica_id": f"r{k}", "member": True, "version": args[1]})
        return Replies(answers)


class PackedWeights:
    kind = "full"

    def __init__(self, tensors: dict[str, Any] | None = None):
        self.tensors = tensors or {}

    def state_dict(self) -> dict[str, Any]:
        return self.tensors


class TrainJob:
    """A Train job's mailbox as the services use it: the task kinds it got, and the results a real job returns."""

    job_id = "job-1"

    def __init__(self, send_error: str | None = None, weights: PackedWeights | None = None):
        self.kinds: list[str] = []
        self.send_error, self.weights = send_error, weights or PackedWeights()

    async def run(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.kinds.append(task["kind"])
        if task["kind"] == "send_weights":
            return [{"metrics": {"send_error": self.send_error} if self.send_error else {"sent_bytes": 1}}]
        if task["kind"] == "save_train_state":
            Path(task["path"]).mkdir(parents=True, exist_ok=True)
            (Path(task["path"]) / ".metadata").write_text("{}")
            return [{"metrics": {}}]
        return [{"metrics": {}, "weights": self.weights}]


# ---- WeightSync ----------------------------------------------------------------------------------------------
def test_object_store_updates_count_versions_and_replicas_that_refuse(tmp_path):
    policy, job = PolicyReplicas(3, refuse=(2,)), TrainJob()
    sync = WeightSync(config(tmp_path), policy, lambda: job)
    assert not sync.has_weights() and asyncio.run(sync.for_new_replica()) is None
    asyncio.run(sync.publish([{"weights": PackedWeights()}]))
    asyncio.run(sync.publish([{"weights": PackedWeights()}]))
    assert sync.version == 2 and policy.versions == [2, 2, 0]
    assert sync.replicas_updated == 2 and sync.replica_failures == 2  # one refusal per update
    latest = asyncio.run(sync.for_new_replica())
    assert latest["version"] == 2 and latest["weights"] is sync.latest
    # The replica that fell behind gets the latest weights again before the next rollout, under a new version.
    policy.refuse.clear()
    asyncio.run(sync.sync_replicas())
    assert sync.replicas == 3 and policy.versions == [3, 3, 3] and sync.version == 3


def test_a_failed_group_transfer_goes_through_the_object_store_and_three_in_a_row_keep_it_there(tmp_path):
    policy, job = PolicyReplicas(2, miss_group=(1,)), TrainJob()
    sync = WeightSync(config(tmp_path, weight_sync={"backend": "gloo", "timeout_s": 5}), policy, lambda: job)
    assert not sync.via_object_store
    asyncio.run(sync.publish([{}]))
    # the group's version failed on replica 1, so it went again through the object store under the next one
    assert sync.version == 2 and sync.fallbacks == 1 and policy.versions == [2, 2]
    assert job.kinds == ["send_weights", "pack_weights"] and sync.replica_failures == 1
    for _ in range(GROUP_FAILURES_MAX - 1):
        asyncio.run(sync.publish([{"weights": PackedWeights()}]))
    assert sync.fallbacks == GROUP_FAILURES_MAX and sync.via_object_store
    sent = len(job.kinds)
    asyncio.run(sync.publish([{"weights": PackedWeights()}]))
    assert job.kinds[sent:] == [] and policy.versions == [sync.version] * 2  # straight through the object store


def test_a_group_transfer_that_works_keeps_no_copy_and_packs_one_on_demand(tmp_path):
    policy, job = PolicyReplicas(2), TrainJob()
    sync = WeightSync(config(tmp_path, weight_sync={"backend": "gloo", "timeout_s": 5}), policy, lambda: job)
    asyncio.run(sync.publish([{}]))
    assert sync.version == 1 and sync.fallbacks == 0 and policy.versions == [1, 1] and sync.latest is None
    latest = asyncio.run(sync.for_new_replica())  # a replica that starts now: the Train job packs a copy
    assert latest["version"] == 1 and job.kinds[-1] == "pack_weights"


def test_a_restore_goes_out_under_a_version_above_every_replicas_and_only_when_needed(tmp_path):
    policy, job = PolicyReplicas(2), TrainJob()
    sync = WeightSync(config(tmp_path), policy, lambda: job)
    packed: list[int] = []

    def pack() -> PackedWeights:
        packed.append(1)
        return PackedWeights()

    asyncio.run(sync.restore(pack))  # every replica holds the run's version already
    assert not packed and sync.version == 0
    policy.versions = [7, 3]  # replicas that outlived an earlier controller hold later weights
    asyncio.run(sync.restore(pack))
    assert packed and sync.version == 8 and policy.versions == [8, 8]


# ---- EnvGroupPool --------------------------------------------------------------------------------------------
class Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class EnvActor:
    """An env-group actor that dies on its first `fail` calls (Ray restarts it: `ready` answers again)."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.ready = Call(self._ready)

    async def _ready(self) -> bool:
        return True


def test_a_failed_actors_share_is_redone_once_then_dropped_and_counted(tmp_path):
    pool = EnvGroupPool(config(tmp_path), "model", policy=None)
    pool.actors = [EnvActor(), EnvActor(fail=1), EnvActor(fail=2)]

    async def call(actor: EnvActor, part: np.ndarray):
        if actor.fail:
            actor.fail -= 1
            raise ray.exceptions.ActorDiedError()
        return part.tolist()

    done, faults = asyncio.run(pool._on_actors(9, call, "groups"))
    assert sorted(done) == [[0, 1, 2], [3, 4, 5]]  # the third actor failed twice: its slice is dropped
    assert faults == [6, 3]  # slices of the second and third actors redone, the third's dropped


def test_rollout_metrics_add_up_the_groups_and_actors(tmp_path):
    parts = [{"group": 0, "episodes": 2, "won": 1, "return_sum": 1.5, "steps": 6, "valid_steps": 3,
              "replica_steps": {"r0": 6}},
             {"group": 1, "episodes": 2, "won": 0, "return_sum": -0.5, "steps": 4, "valid_steps": 4,
              "replica_steps": {"r1": 4}},
             {"rerolled_groups": 1, "dropped_groups": 0, "seconds": 2.0}]
    m = rollout_metrics(parts, "train")
    assert m["train/success_rate"] == 0.25 and m["train/return"] == 0.25 and m["train/episodes"] == 4
    assert m["train/valid_action_ratio"] == 0.7 and m["perf/env_steps_per_s"] == 5.0
    assert m["perf/replicas_answering"] == 2 and m["faults/rerolled_groups"] == 1
    assert "perf/env_steps_per_s" not in rollout_metrics(parts, "val")


# ---- Checkpointer --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model() -> str:
    from app.default_model import resolve_model

    return resolve_model("default:tiny")


def checkpointer(tmp_path: Path, model: str, **args: Any) -> tuple[Checkpointer, WeightSync, TrainJob]:
    from actors.checkpoint import load_model_weights

    cfg = config(tmp_path, **args)
    job = TrainJob(weights=PackedWeights(load_model_weights(model)))
    sync = WeightSync(cfg, PolicyReplicas(1), lambda: job)
    return Checkpointer(cfg, cfg.model_dump(mode="json"), cfg.run_dir, model, None, None, sync, lambda: job), sync, job


def test_checkpoints_rotate_keep_what_is_pinned_and_answer_requests(tmp_path, tiny_model):
    from actors.checkpoint import list_checkpoints, load_state

    ckpt, sync, job = checkpointer(tmp_path, tiny_model, checkpoint={"every": 2, "keep": 1})
    asyncio.run(ckpt.prepare())
    assert [ckpt.due(i, stopping=False) for i in (1, 2, 3)] == [False, True, True]  # every 2, and the last (3)
    assert ckpt.due(1, stopping=True)

    async def iterations():
        waiter = ckpt.request()  # a `/checkpoint` request: answered at the end of the running iteration
        state = {"iteration": 1, "warm_start_done": True, "reference_model": "reference"}
        await ckpt.answer_requests(lambda: ckpt.write(state))
        return await waiter

    first = asyncio.run(iterations())
    assert first.name == "iter_000001" and ckpt.last == str(first) and job.kinds == ["pack_weights",
                                                                                  "save_train_state"]
    assert load_state(first)["reference_model"] == "reference"
    assert json.loads((first / "model" / "raygent_agent.json").read_text())["source"]["iteration"] == 1
    ckpt.resume_from = first  # a run that resumed from iteration 1 keeps it while it lives
    for it in (2, 3):
        asyncio.run(ckpt.write({"iteration": it, "warm_start_done": True, "reference_model": "reference"}))
    assert [p.name for p in list_checkpoints(ckpt.run_dir)] == ["iter_000001", "iter_000003"]


def test_a_disk_that_refuses_a_checkpoint_is_counted_and_the_last_one_stays(tmp_path, tiny_model):
    ckpt, _, job = checkpointer(tmp_path, tiny_model, checkpoint={"every": 1, "keep": 2})
    asyncio.run(ckpt.prepare())
    first = asyncio.run(ckpt.write({"iteration": 1, "warm_start_done": False, "reference_model": tiny_model}))

    async def full_disk(task):
        return [{"metrics": {}, "write_error": "OSError: [Errno 28] No space left on device"}] \
            if task["kind"] == "save_train_state" else [{"metrics": {}, "weights": job.weights}]

    job.run = full_disk
    again = asyncio.run(ckpt.write({"iteration": 2, "warm_start_done": False, "reference_model": tiny_model}))
    assert again == first and ckpt.failures == 1 and ckpt.last == str(first)
    assert not list(ckpt.run_dir.joinpath("checkpoints").glob(".tmp-*"))


def test_the_checkpoint_a_run_starts_from_is_pinned(tmp_path, tiny_model):
    ckpt, _, _ = checkpointer(tmp_path, tiny_model)
    ckpt.model_path = str(ckpt.run_dir / "checkpoints" / "iter_000004" / "model")
    ckpt.resume_from = ckpt.run_dir / "checkpoints" / "iter_000006"
    assert ckpt.pinned() == {ckpt.run_dir / "checkpoints" / "iter_000004", ckpt.resume_from}
    # its copy in storage pins it too
    ckpt.model_path = "s3://bucket/runs/e2e-tiny/checkpoints/iter_000005/model?endpoint_override=x"
    assert ckpt.run_dir / "checkpoints" / "iter_000005" in ckpt.pinned()


# ---- TrainJobSupervisor --------------------------------------------------------------------------------------
def test_a_failed_train_job_restarts_from_the_last_checkpoint_until_max_restarts(tmp_path, tiny_model):
    cfg = config(tmp_path, trainer={"num_workers": 2, "max_restarts": 2})
    supervisor = TrainJobSupervisor(cfg, cfg.run_dir, None, tiny_model, tiny_model)
    assert supervisor.pad_id == 0  # the default tokenizer's <|pad|>
    assert supervisor.restart_point(TrainerFailure("rank 1 died")) is None  # nothing checkpointed: from the start
    checkpoint = cfg.run_dir / "checkpoints" / "iter_000003"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    assert supervisor.restart_point(TrainerFailure("rank 0 hung")) == checkpoint
    assert supervisor._start_model(checkpoint) == str(checkpoint / "model")
    with pytest.raises(RuntimeError, match="failed 3 times"):
        supervisor.restart_point(TrainerFailure("again"))
