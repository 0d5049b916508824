"""How the run's weights reach the Policy replicas, and the version they go under.

The controller builds one `WeightSync` per run and calls `publish` after every update. Two paths
(`weight_sync.backend`):
- object store: the Train job packs its weights in buckets into the object store (actors/weights.py) and every
  replica loads them (`broadcast`); the latest copy stays there for checkpoints and replicas that start later;
- a collective group (gloo, nccl): Train rank 0 broadcasts the buckets straight to every replica's engine
  (`send_over_group`), nothing through the object store; a copy is packed only when one is needed (`stored`).
A transfer over the group that fails (a member gone) goes through the object store instead under the next
version, and after GROUP_FAILURES_MAX failures in a row every later one does. A replica that starts mid-run asks
for the latest weights before it serves (`for_new_replica`); one that fell behind gets them again before the next
rollout (`sync_replicas`). Versions only grow: a restore from a checkpoint goes out under a version above every
replica's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.config import TrainConfig
from actors.trainer import TrainerFailure, TrainerGroup
from actors.weights import Weights

logger = logging.getLogger("raygent")
BROADCAST_TIMEOUT_S = 900.0  # an object-store update of every replica (requests in flight finish first)
GROUP_FAILURES_MAX = 3  # weight-group transfers failed in a row before the run keeps to the object store
REPLICA_INFO_TIMEOUT_S = 120.0


def why(e: BaseException) -> str:
    """An exception in one short line, for logs and status."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def serve_on_policy() -> str:
    """What Serve says about the Policy deployment's replicas (why they are not running), or that it says nothing."""
    from ray import serve

    try:
        for app in serve.status().applications.values():
            deployment = app.deployments.get("Policy")
            if deployment is not None and deployment.message:
                return f"Serve says: {deployment.message}"
    except Exception as e:
        return f"Serve's status is not available ({why(e)})"
    return "Serve gives no reason (see the Serve log)"


class WeightSync:
    """The run's weight version and its transfers to the Policy replicas. `trainer()` is the run's Train job of the
    moment (a restart replaces it)."""

    def __init__(self, cfg: TrainConfig, policy: Any, trainer: Callable[[], TrainerGroup]):
        self.cfg = cfg
        self.policy = policy
        self._trainer = trainer
        self.version = 0
        # The latest weights in the object store and their version: every update's on the object-store path; on
        # the collective path only a copy the Train job packed on demand (`stored`).
        self.latest: Weights | None = None
        self._stored_version = -1
        self._sent_version: int | None = None  # the last version sent over a weight group
        # Held while the Train job's weights change and go out (an update, then its sync): the weights it holds are
        # of no version until then, so a copy for a new replica is packed only outside it.
        self.update_lock = asyncio.Lock()
        self._store_lock = asyncio.Lock()
        self._tcp_store: Any = None  # where weight groups meet (hosted by the controller's process, for the run)
        self._group: dict[str, Any] | None = None
        self._group_key: tuple = ()
        self.fallbacks = 0  # transfers over the group that went through the object store instead
        self._failures_in_a_row = 0
        self.replica_failures = 0  # replicas that did not take a version
        self.replicas = 0  # replicas that answered the last sync check
        self.replicas_updated = 0  # replicas that took the last transfer

    # ---- replicas --------------------------------------------------------------------------------------------
    async def replica_infos(self) -> list[dict[str, Any]]:
        infos = await asyncio.wait_for(self.policy.broadcast("info").results_async(return_exceptions=True),
                                       REPLICA_INFO_TIMEOUT_S)
        return [i for i in infos if isinstance(i, dict)]

    async def wait_for_replicas(self) -> None:
        """A Policy replica answers, or the run fails within rollout.policy_timeout_s with Serve's own word on why
        (e.g. the resources each replica asks for, which no node has), instead of every rollout waiting for
        replicas that never start."""
        deadline = time.monotonic() + self.cfg.rollout.policy_timeout_s
        while True:
            try:
                if await self.replica_infos():
                    return
            except Exception:  # none running yet (Serve may say so with an error)
                pass
            if time.monotonic() > deadline:
                reason = await asyncio.to_thread(serve_on_policy)
                raise RuntimeError(f"no Policy replica answered within rollout.policy_timeout_s "
                                   f"({self.cfg.rollout.policy_timeout_s:.0f}s): {reason}; check the Policy "
                                   "deployment's ray_actor_options (resources, num_gpus) against the cluster's nodes")
            await asyncio.sleep(2.0)

    async def check_backend(self) -> None:
        """NCCL moves GPU memory only: with backend nccl, every replica must have a GPU (checked before anything
        starts)."""
        if self.cfg.weight_sync.backend != "nccl":
            return
        without = [i["replica_id"] for i in await self.replica_infos() if not i.get("cuda")]
        if without:
            raise RuntimeError(f"weight_sync.backend 'nccl': Policy replicas {without} have no GPU; give the Policy "
                               "deployment ray_actor_options num_gpus (or use weight_sync.backend 'object_store')")

    # ---- sending ---------------------------------------------------------------------------------------------
    @property
    def via_object_store(self) -> bool:
        """Whether updates go through the object store: the configured backend, or the collective one after it
        failed GROUP_FAILURES_MAX times in a row (each failure costs up to weight_sync.timeout_s)."""
        return self.cfg.weight_sync.backend == "object_store" or self._failures_in_a_row >= GROUP_FAILURES_MAX

    def has_weights(self) -> bool:
        """Whether the run has put weights on the replicas (trained or restored from a checkpoint)."""
        return self.latest is not None or self._sent_version is not None

    async def publish(self, results: list[Any]) -> None:
        """The weights the Train job has just made (its task's `results`), to every replica under the next
        version."""
        if self.via_object_store:
            await self.broadcast(results[0]["weights"])
        else:
            await self.send_over_group()

    async def broadcast(self, weights: Weights) -> None:
        """Weights in the object store to every replica under the next version. A replica that fails to take them is
        logged and counted, and stays behind: the next sync check retries it, and until then its rows are dropped as
        stale."""
        self.version += 1
        self.latest, self._stored_version = weights, self.version
        try:  # a replica that never answers (its engine stuck) must not hold the run: it counts as failed
            results = await asyncio.wait_for(self.policy.broadcast("update_weights", weights, self.version)
                                             .results_async(return_exceptions=True), BROADCAST_TIMEOUT_S)
        except asyncio.TimeoutError as e:
            results = [e]
        failed = [r for r in results if isinstance(r, BaseException)]
        self.replicas_updated = len(results) - len(failed)
        if failed:
            self.replica_failures += len(failed)
            logger.warning("%d of %d replicas did not take weight version %d: %s", len(failed), len(results),
                           self.version, why(failed[0]))

    async def send_over_group(self) -> None:
        """The collective path: Train rank 0 broadcasts the weights it holds to every replica's engine under the
        next version, nothing through the object store. A replica that starts after the group formed is not in it
        (the next sync check catches it up). A transfer that fails (a member gone: each operation has
        weight_sync.timeout_s) is counted, and the weights go through the object store instead."""
        try:
            members = sorted(i["replica_id"] for i in await self.replica_infos())
        except Exception as e:  # no replica reachable now: the object store path counts what it can reach
            logger.warning("no replica answered before a weight update (%s)", why(e))
            members = []
        self.version += 1
        failure = await self._transfer(members) if members else "no replica answered"
        if failure is None:
            self._sent_version, self._failures_in_a_row = self.version, 0
            if self._stored_version != self.version:
                self.latest = None  # an older copy: no reason to keep it in the object store
            return
        self._group = None  # its state is unknown: the next transfer forms a new one
        self.fallbacks += 1
        self._failures_in_a_row += 1
        logger.warning("weight version %d over the %s group failed (%s); sending it through the object store%s",
                       self.version, self.cfg.weight_sync.backend, failure,
                       f", and every later update too ({GROUP_FAILURES_MAX} failures in a row)"
                       if self.via_object_store else "")
        results = await self._trainer().run({"kind": "pack_weights", "want_weights": True})
        await self.broadcast(results[0]["weights"])

    async def _transfer(self, members: list[str]) -> str | None:
        """One transfer of the current version over the group of these replicas; None, or what failed. The sender's
        operations each have a deadline, so its task ends; the receivers then get `timeout_s` to finish loading."""
        group = self._group_for(members)
        send = asyncio.ensure_future(self._trainer().run({"kind": "send_weights", "group": group,
                                                          "version": self.version}))
        receive = asyncio.ensure_future(
            self.policy.broadcast("receive_weights", group, self.version).results_async(return_exceptions=True))
        await asyncio.wait({send, receive}, return_when=asyncio.FIRST_COMPLETED)
        if not send.done():  # the replicas answered first (or could not be called): the sender ends on its own
            await asyncio.wait({send})
        if send.exception() is not None:  # the Train job failed: the run restarts it
            receive.add_done_callback(lambda f: f.exception())  # its members give up on their own
            raise send.exception()
        sent = send.result()[0]["metrics"]
        try:  # the sender is done, so every bucket has left: the replicas only finish loading
            received = await asyncio.wait_for(receive, self.cfg.weight_sync.timeout_s)
        except asyncio.TimeoutError:
            return f"replicas still loading {self.cfg.weight_sync.timeout_s:.0f}s after the sender finished"
        except Exception as e:
            return f"the replicas could not be called: {why(e)}"
        took = {r["replica_id"] for r in received if isinstance(r, dict) and r.get("member")}
        self.replicas_updated = len(took)
        failed = [r for r in received if isinstance(r, BaseException)]
        if sent.get("send_error") or took != set(group["ranks"]):
            self.replica_failures += len(set(group["ranks"]) - took)
            return (f"sender: {sent.get('send_error', 'ok')}; {len(set(group['ranks']) - took)} of "
                    f"{len(group['ranks'])} replicas did not take it"
                    + (f" ({why(failed[0])})" if failed else ""))
        return None

    def _group_for(self, members: list[str]) -> dict[str, Any]:
        """The weight group of this Train job and these replicas: the one formed before, or a new one (a replica
        came or went, the job restarted, or the last transfer failed). Its members meet at a TCPStore hosted here."""
        import uuid

        import torch.distributed as dist

        from actors.weights import GroupSpec

        key = (self._trainer().job_id, tuple(members))
        if self._group is None or self._group_key != key:
            host = ray.util.get_node_ip_address()
            if self._tcp_store is None:
                self._tcp_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            ranks = {replica: rank for rank, replica in enumerate(members, start=1)}
            self._group = GroupSpec(f"raygent-weights-{uuid.uuid4().hex[:8]}", host, self._tcp_store.port,
                                    self.cfg.weight_sync.backend, self.cfg.weight_sync.timeout_s, ranks).to_dict()
            self._group_key = key
        return self._group

    # ---- copies in the object store --------------------------------------------------------------------------
    async def stored(self) -> Weights:
        """The current version's weights in the object store: those of the last broadcast, or on the collective path
        packed by the Train job, which holds the current version's weights between updates."""
        async with self._store_lock:
            if self.latest is None or self._stored_version != self.version:
                version = self.version
                results = await self._trainer().run({"kind": "pack_weights", "want_weights": True})
                if self.version == version:  # else a restore or broadcast has put newer ones there meanwhile
                    self.latest, self._stored_version = results[0]["weights"], version
            return self.latest

    async def for_new_replica(self) -> dict[str, Any] | None:
        """What a (re)starting policy replica loads before it serves: the latest weights and their version (None
        before any). On the collective path the Train job packs them now, after the update under way (if any) has
        gone out; if that fails, the replica starts behind and the sync check before the next rollout catches it
        up."""
        if not self.has_weights():
            return None
        if self._stored_version != self.version:
            try:  # no deadline here: the replica has its own, and a pack left half-awaited would pin its copy
                async with self.update_lock:
                    await self.stored()
            except TrainerFailure:
                return None
        if self.latest is None or self._stored_version != self.version:
            return None
        return {"version": self.version, "weights": self.latest}

    # ---- keeping replicas level ------------------------------------------------------------------------------
    async def sync_replicas(self) -> None:
        """Before a rollout: every replica on the latest weights. A replica that restarted and could not sync
        itself from the run, or missed a broadcast, gets them again (under a new version, so nothing rolls back)."""
        try:
            infos = await asyncio.wait_for(
                self.policy.broadcast("info").results_async(return_exceptions=True), REPLICA_INFO_TIMEOUT_S)
        except asyncio.TimeoutError:
            infos = [None]
        versions = [i["version"] if isinstance(i, dict) else None for i in infos]
        self.replicas = sum(isinstance(i, dict) for i in infos)
        if self.has_weights() and any(v is not None and v != self.version for v in versions):
            logger.warning("replica versions %s differ from %d: re-broadcasting", versions, self.version)
            if self.via_object_store:
                await self.broadcast(await self.stored())
            else:
                async with self.update_lock:
                    await self.send_over_group()

    async def restore(self, pack: Callable[[], Weights], always: bool = False) -> None:
        """Put weights held outside the Train job (a checkpoint's, packed by `pack` in a thread) on every replica,
        under a version above every replica's, unless (`always` False) they all hold the run's version already."""
        infos = await self.policy.broadcast("info").results_async(return_exceptions=True)
        versions = [i["version"] for i in infos if isinstance(i, dict)]
        if not always and versions and all(v == self.version for v in versions):
            return
        weights = await asyncio.to_thread(pack)
        self.version = max([self.version, *versions])
        await self.broadcast(weights)

    async def resend_from_trainer(self) -> None:
        """A new Train job without a checkpoint holds the starting weights: they replace whatever the replicas hold
        (the lost job's), under a version above every replica's."""
        results = await self._trainer().run({"kind": "pack_weights", "want_weights": True})
        infos = await self.policy.broadcast("info").results_async(return_exceptions=True)
        self.version = max([self.version, *(i["version"] for i in infos if isinstance(i, dict))])
        await self.broadcast(results[0]["weights"])
