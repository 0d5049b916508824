"""The policy on Ray Serve: replicas that each own one engine (vLLM synchronous or async, or transformers), batch
concurrent requests (the async engine continuously, the others per `serve.batch`), report the weight version that
produced every reply, and take new weights in place between requests (`WeightGate`).

Replicas, autoscaling and per-replica resources come from the Serve config (`deployments:` of the application);
the defaults below only make a bare `Policy.bind(...)` runnable on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.config import PolicyConfig, SamplingConfig
from actors.lora import write_adapter
from actors.metrics import quiet_frameworks
from actors.prompting import encode_chat
from actors.weights import TransferError, Weights, receive_into
from app.default_model import resolve_model
from app.engines import AsyncVLLMEngine, Completion, HFEngine, completion_reply, make_engine
from app.routing import ROUTER

logger = logging.getLogger("ray.serve")
# How long a (re)starting replica may spend taking the run's latest weights before it serves without them (the
# controller's sync check before the next rollout then catches it up).
SYNC_DEADLINE_S = 300.0


class WeightGate:
    """Every reply comes from exactly one weight version: requests pass while no update is waiting; an update
    closes the gate to new requests, waits for the ones in flight to finish (on the old weights), loads, and opens
    it again. So in-flight requests finish on the weights they started with and a request that arrives during an
    update waits for it, and the version read inside the gate is the one that produces the reply."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._updating = asyncio.Lock()  # one update at a time

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1  # no await between the check and this: an update cannot slip in
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        async with self._updating:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


# A replica being stopped (scale-down, a new config, an app deleted) checks every half second whether its last
# request has finished (Serve's default: every 2 s), so an idle one goes at once; one mid-request still gets
# graceful_shutdown_timeout_s.
@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024, graceful_shutdown_wait_loop_s=0.5,
                  request_router_config=RequestRouterConfig(request_router_class=ROUTER))
class Policy:
    async def __init__(self, config: dict[str, Any] | PolicyConfig | None = None):
        self.config = PolicyConfig.model_validate(config or {})
        quiet_frameworks(self.config.log_level)
        self.model_path = resolve_model(self.config.model)
        self.engine = make_engine(
            self.config.engine, self.model_path, dtype=self.config.dtype, max_model_len=self.config.max_model_len,
            kv_cache_bytes=self.config.kv_cache_bytes, gpu_memory_utilization=self.config.gpu_memory_utilization,
            seed=self.config.seed, lora=self.config.lora,
            adapter=resolve_model(self.config.adapter) if self.config.adapter else None,
        )
        self._adapter_dir: str | None = None  # this replica's copy of the latest trained adapter (LoRA runs)
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.version = self.config.initial_version
        self._gate = WeightGate()
        self._engine_error: str | None = None
        # A collective transfer that failed after the engine's weights began to change: half old, half new. The
        # replica refuses requests until a full update succeeds (the controller sends one at once, through the
        # object store), and stays healthy meanwhile: replacing every replica of a failed transfer at once would
        # leave the run with none.
        self._half_loaded: str | None = None
        if self.config.sync_from:
            await self._sync_from_run()
        self._generate_batch.set_max_batch_size(self.config.max_batch_size)
        self._generate_batch.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # not inside Serve (in-process use in benchmarks)
            self.replica_id = "local"
        logger.info("policy replica %s: engine %s, model %s", self.replica_id, self.engine.name, self.model_path)

    async def _sync_from_run(self) -> None:
        """A replica that (re)starts during a run serves the run's latest weights, not its starting ones: it asks
        the run's controller before Serve routes it any request. At the very start there is no controller (or no
        trained weights) yet, and the starting weights are the latest."""
        import ray

        deadline = time.monotonic() + SYNC_DEADLINE_S
        try:
            controller = ray.get_actor(self.config.sync_from, namespace="raygent")
        except ValueError:  # no such actor: the run has not started yet
            return
        while True:
            try:
                # on the collective path the controller may first wait for the update under way to go out
                latest = await asyncio.wait_for(controller.latest_weights_for_replica.remote(),
                                                max(1.0, deadline - time.monotonic()))
                if latest is not None and latest["version"] > self.version:
                    await self._load(latest["weights"])
                    self.version = int(latest["version"])
                    logger.warning("policy replica synced to the run's weight version %d", self.version)
                return
            except ray.exceptions.ObjectLostError as e:
                # A copy the Train job packed, lost with a Train worker that died since: the controller restarts
                # the job and puts a checkpoint's weights (held by the controller) in their place; ask again.
                if time.monotonic() > deadline:
                    logger.warning("policy replica could not sync from %s (%s)", self.config.sync_from, e)
                    return
                logger.warning("policy replica: the run's weights were lost with their Train worker; asking again")
                await asyncio.sleep(2)
            except Exception as e:  # the controller's next sync check catches up; never fail the replica for it
                logger.warning("policy replica could not sync from %s (%s)", self.config.sync_from, e)
                return

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine failed is replaced (and the new one syncs from the run)."""
        if self._engine_error is not None:
            raise RuntimeError(f"the engine failed: {self._engine_error}")

    # ---- generation -------------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _generate_one(self, ids: list[int], params: SamplingConfig) -> dict[str, Any]:
        """One request through the gate: the async engine takes it as it is (vLLM batches whatever runs at once);
        a synchronous engine gets it in a batch of the requests that arrive together."""
        async with self._gate.request():
            version = self.version
            if self._engine_error is not None:  # its state is unknown: Serve replaces this replica
                raise RuntimeError(f"this replica's engine failed ({self._engine_error}); Serve is replacing it")
            if self._half_loaded is not None:  # never serve half-loaded weights
                raise RuntimeError(f"this replica's weights are half loaded ({self._half_loaded}); it serves "
                                   "again after the next full update")
            try:
                if isinstance(self.engine, AsyncVLLMEngine):
                    started = time.perf_counter()
                    completion = await self.engine.generate_one(ids, params)
                    return self._reply(completion, version, time.perf_counter() - started, None)
                return await self._generate_batch((ids, params))
            except self.engine.request_errors:
                raise  # the request's fault: the engine is fine
            except asyncio.CancelledError:
                raise  # the caller went away
            except Exception as e:  # the engine's own: its state is unknown, so the replica reports unhealthy and
                self._engine_error = f"{type(e).__name__}: {e}"  # Serve replaces it
                raise

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.005)
    async def _generate_batch(self, items: list[tuple[list[int], SamplingConfig]]) -> list[dict[str, Any]]:
        # every item is inside the gate: the version cannot change until the batch is done
        version = self.version
        started = time.perf_counter()
        completions = await asyncio.to_thread(
            self.engine.generate, [ids for ids, _ in items], [params for _, params in items]
        )
        seconds = time.perf_counter() - started
        return [self._reply(c, version, seconds, len(items)) for c in completions]

    def _reply(self, c: Completion, version: int, seconds: float, batch: int | None) -> dict[str, Any]:
        # batch_size: the engine call's batch; None for the async engine, whose batch changes at every step
        return {**completion_reply(c, version), "replica_id": self.replica_id, "engine_seconds": seconds,
                "batch_size": batch}

    def _check_length(self, ids: list[int], params: SamplingConfig) -> None:
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds max_model_len "
                             f"{self.config.max_model_len}; shorten the prompt or lower max_tokens")
        if not ids:
            raise ValueError("empty prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}): the tokenizer's vocabulary")

    async def generate(self, prompts: list[list[int]] | list[str] | list[list[dict[str, str]]],
                       sampling: dict[str, Any] | SamplingConfig | list[dict[str, Any]] | None = None,
                       affinity: int | None = None) -> list[dict[str, Any]]:
        """Generate one reply per prompt. A prompt is token ids, a raw text, or a chat (list of messages, formatted
        with the model's chat template); `sampling` is one setting for all, or a list with one per prompt (e.g. a
        seed each). Concurrent callers are batched together into one engine call. `affinity` is read by the router
        only (`app.routing`): requests with the same key go to the same replica."""
        given = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(given) != len(prompts):
            raise ValueError(f"{len(given)} sampling settings for {len(prompts)} prompts")
        try:
            params = [s if isinstance(s, SamplingConfig) else SamplingConfig.model_validate(s or {}) for s in given]
        except ValidationError as e:  # re-raised as a plain ValueError: it crosses Ray with its type intact
            raise ValueError(f"invalid sampling settings: {e}") from None
        encoded = [self._encode(p) for p in prompts]
        for ids, p in zip(encoded, params, strict=True):
            self._check_length(ids, p)
        return list(await asyncio.gather(*(self._generate_one(ids, p) for ids, p in zip(encoded, params, strict=True))))

    def _encode(self, prompt: list[int] | str | list[dict[str, str]]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode_text(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]  # type: ignore[union-attr]

    # ---- weights -----------------------------------------------------------------------------------------------
    async def update_weights(self, weights: Weights, version: int) -> dict[str, Any]:
        """Load a full set of weights (streamed into the engine one bucket at a time, zero-copy views of the object
        store), or a LoRA run's adapter, as weight `version`. Generation waits for the running batch, then for the
        update: every reply comes from one version. Versions only go up: an older or equal one is refused, so a
        late broadcast can never roll back."""
        if weights.dtype != self.config.dtype:
            raise ValueError(f"weights in {weights.dtype} for an engine in {self.config.dtype}")
        started = time.perf_counter()
        async with self._gate.update():
            if version <= self.version:  # checked inside the gate: a concurrent update may have got there first
                raise ValueError(f"weight version {version} is not newer than the replica's {self.version}")
            try:
                await self._load(weights)
            except Exception as e:  # a half-loaded engine must not serve: Serve replaces the replica, which syncs
                self._engine_error = f"weight update failed: {type(e).__name__}: {e}"  # from the run
                raise
            if weights.kind == "full":
                self._half_loaded = None
            self.version = version
        return {"replica_id": self.replica_id, "version": version, "seconds": time.perf_counter() - started,
                "bytes": weights.nbytes}

    async def receive_weights(self, group: dict[str, Any], version: int) -> dict[str, Any]:
        """The collective path (`weight_sync.backend` gloo / nccl): take weight `version` as a member of the weight
        group `group` (`actors.weights.GroupSpec`), broadcast by Train rank 0 while this runs. Full weights stream
        into the engine's own process bucket by bucket as they arrive; an adapter is received here and swapped in
        as `update_weights` does. The gate works as for `update_weights`. A replica that is not in the group (it
        started after the group was formed) takes no part; the controller's next sync check catches it up. A
        transfer that fails after the engine's weights began to change leaves them half loaded: the replica
        refuses requests until a full update succeeds."""
        rank = group["ranks"].get(self.replica_id)
        if rank is None:
            return {"replica_id": self.replica_id, "member": False, "version": self.version}
        started = time.perf_counter()
        async with self._gate.update():
            stale = version <= self.version  # received all the same: the sender waits for every member
            try:
                adapter: dict[str, Any] = {}
                if self.config.lora is None and isinstance(self.engine, AsyncVLLMEngine):
                    received = await self.engine.receive_weights(group, rank, version, self.config.dtype,
                                                                 discard=stale)
                else:
                    received = await asyncio.to_thread(self._receive_here, group, rank, version, stale, adapter)
            except TransferError as e:
                if e.loading_began:
                    self._half_loaded = f"weight version {version} failed while loading: {e}"
                raise RuntimeError(f"weight version {version} over the {group['backend']} group failed: "
                                   f"{e}") from None
            if stale:
                raise ValueError(f"weight version {version} is not newer than the replica's {self.version}")
            if adapter:  # received whole: swapping it in either works or leaves the previous adapter serving
                await self._load_adapter(adapter)
            else:
                self._half_loaded = None
            self.version = version
        return {"replica_id": self.replica_id, "member": True, "version": version,
                "seconds": time.perf_counter() - started, "bytes": received}

    def _receive_here(self, group: dict[str, Any], rank: int, version: int, discard: bool,
                      adapter: dict[str, Any]) -> int:
        """Receive in this process: the synchronous engines own their model here (vLLM loads each bucket as it
        arrives; transformers takes the whole state dict, so it is collected first); an adapter is collected into
        `adapter`, then swapped in from the event loop."""

        def load(header: dict[str, Any], tensors: Any, began: Any) -> None:
            if discard:
                for _ in tensors:
                    pass
            elif header["kind"] == "adapter":
                adapter.update((name, tensor.cpu()) for name, tensor in tensors)
            elif isinstance(self.engine, HFEngine):
                state = dict(tensors)
                began()
                self.engine.load_weights(state.items())
            else:
                began()
                self.engine.load_weights(tensors)

        return receive_into(group, rank, version, self.config.dtype, load)

    async def _load(self, weights: Weights) -> None:
        if weights.kind == "adapter":
            await self._load_adapter(await asyncio.to_thread(weights.state_dict))
        elif isinstance(self.engine, AsyncVLLMEngine):
            await self.engine.load_weights(weights)
        else:
            await asyncio.to_thread(self.engine.load_weights, weights.tensors())

    async def _load_adapter(self, state: dict[str, Any]) -> None:
        """A LoRA run's update: the adapter alone, written as a folder on this node (the engines load adapters from
        folders), served from now on; the previous folder goes."""
        if self.config.lora is None:
            raise ValueError("adapter weights for a replica without policy.lora")
        folder = tempfile.mkdtemp(prefix="raygent-adapter-")
        try:
            await asyncio.to_thread(write_adapter, folder, state, self.config.lora, self.model_path)
            if isinstance(self.engine, AsyncVLLMEngine):
                await self.engine.load_adapter(folder)
            else:
                await asyncio.to_thread(self.engine.load_adapter, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._adapter_dir = self._adapter_dir, folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: the async engine's core process goes with it
        if isinstance(getattr(self, "engine", None), AsyncVLLMEngine):
            self.engine.shutdown()
        if getattr(self, "_adapter_dir", None):
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    async def info(self, affinity: int | None = None) -> dict[str, Any]:
        """This replica's state; `affinity` (router only) picks the replica as it would for `generate`."""
        import torch

        return {"replica_id": self.replica_id, "pid": os.getpid(), "version": self.version, "engine": self.engine.name,
                "model_path": self.model_path, "max_model_len": self.config.max_model_len,
                "torch_threads": torch.get_num_threads(), "prefix_cache": self.engine.prefix_cache(),
                "cuda": torch.cuda.is_available(), "healthy": self._engine_error is None,
                "half_loaded": self._half_loaded is not None}


def build_policy_app(args: dict[str, Any]) -> serve.Application:
    """`serve run` entry: `import_path: app.policy:build_policy_app`, `args:` a PolicyConfig."""
    return Policy.bind(PolicyConfig.model_validate(args).model_dump())
