"""The policy on Ray Serve: replicas that each own one engine (vLLM or transformers), batch concurrent requests,
report the weight version that produced every reply, and take new weights in place.

Replicas, autoscaling and per-replica resources come from the Serve config (`deployments:` of the application);
the defaults below only make a bare `Policy.bind(...)` runnable on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import ValidationError
from ray import serve

from actors.config import PolicyConfig, SamplingConfig
from actors.metrics import quiet_frameworks
from actors.prompting import encode_chat
from actors.weights import Weights
from app.default_model import resolve_model
from app.engines import Completion, completion_reply, make_engine

logger = logging.getLogger("ray.serve")


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
class Policy:
    def __init__(self, config: dict[str, Any] | PolicyConfig | None = None):
        self.config = PolicyConfig.model_validate(config or {})
        quiet_frameworks(self.config.log_level)
        self.model_path = resolve_model(self.config.model)
        self.engine = make_engine(
            self.config.engine, self.model_path, dtype=self.config.dtype, max_model_len=self.config.max_model_len,
            kv_cache_bytes=self.config.kv_cache_bytes, gpu_memory_utilization=self.config.gpu_memory_utilization,
            seed=self.config.seed,
        )
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.version = self.config.initial_version
        if self.config.sync_from:
            self._sync_from_run()
        # The engine runs one batch at a time; weight updates wait for the running batch (and vice versa), so every
        # reply is produced by exactly one weight version.
        self._engine_lock = asyncio.Lock()
        self._engine_error: str | None = None
        self._generate_batch.set_max_batch_size(self.config.max_batch_size)
        self._generate_batch.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # not inside Serve (in-process use in benchmarks)
            self.replica_id = "local"
        logger.info("policy replica %s: engine %s, model %s", self.replica_id, self.engine.name, self.model_path)

    def _sync_from_run(self) -> None:
        """A replica that (re)starts during a run serves the run's latest weights, not its starting ones: it asks
        the run's controller before Serve routes it any request. At the very start there is no controller (or no
        trained weights) yet, and the starting weights are the latest."""
        import ray

        try:
            controller = ray.get_actor(self.config.sync_from, namespace="raygent")
            latest = ray.get(controller.latest_weights_for_replica.remote(), timeout=120)
            if latest is not None and latest["version"] > self.version:
                self.engine.load_weights(latest["weights"].tensors(timeout_s=300))
                self.version = int(latest["version"])
                logger.warning("policy replica synced to the run's weight version %d", self.version)
        except ValueError:  # no such actor: the run has not started yet
            pass
        except Exception as e:  # the controller's next sync check catches up; never fail the replica for it
            logger.warning("policy replica could not sync from %s (%s)", self.config.sync_from, e)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine failed is replaced (and the new one syncs from the run)."""
        if self._engine_error is not None:
            raise RuntimeError(f"the engine failed: {self._engine_error}")

    # ---- generation -------------------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.005)
    async def _generate_batch(self, items: list[tuple[list[int], SamplingConfig]]) -> list[dict[str, Any]]:
        async with self._engine_lock:
            version = self.version
            started = time.perf_counter()
            try:
                completions = await asyncio.to_thread(
                    self.engine.generate, [ids for ids, _ in items], [params for _, params in items]
                )
            except self.engine.request_errors:
                raise  # the request's fault: the engine is fine
            except Exception as e:  # the engine's own: its state is unknown, so the replica reports unhealthy and
                self._engine_error = f"{type(e).__name__}: {e}"  # Serve replaces it
                raise
            seconds = time.perf_counter() - started
        return [self._reply(c, version, seconds, len(items)) for c in completions]

    def _reply(self, c: Completion, version: int, seconds: float, batch: int) -> dict[str, Any]:
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
                       sampling: dict[str, Any] | SamplingConfig | list[dict[str, Any]] | None = None
                       ) -> list[dict[str, Any]]:
        """Generate one reply per prompt. A prompt is token ids, a raw text, or a chat (list of messages, formatted
        with the model's chat template); `sampling` is one setting for all, or a list with one per prompt (e.g. a
        seed each). Concurrent callers are batched together into one engine call."""
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
        return list(await asyncio.gather(*(self._generate_batch((ids, p))
                                           for ids, p in zip(encoded, params, strict=True))))

    def _encode(self, prompt: list[int] | str | list[dict[str, str]]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode_text(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]  # type: ignore[union-attr]

    # ---- weights -----------------------------------------------------------------------------------------------
    async def update_weights(self, weights: Weights, version: int) -> dict[str, Any]:
        """Load a full set of weights as weight `version`, streamed into the engine one bucket at a time (zero-copy
        views of the object store). Generation waits for the running batch, then for the update: every reply comes
        from one version. Versions only go up: an older or equal one is refused, so a late broadcast can never roll
        back."""
        if version <= self.version:
            raise ValueError(f"weight version {version} is not newer than the replica's {self.version}")
        if weights.dtype != self.config.dtype:
            raise ValueError(f"weights in {weights.dtype} for an engine in {self.config.dtype}")
        started = time.perf_counter()
        async with self._engine_lock:
            await asyncio.to_thread(self.engine.load_weights, weights.tensors())
            self.version = version
        return {"replica_id": self.replica_id, "version": version, "seconds": time.perf_counter() - started,
                "bytes": weights.nbytes}

    async def info(self) -> dict[str, Any]:
        import torch

        return {"replica_id": self.replica_id, "version": self.version, "engine": self.engine.name,
                "model_path": self.model_path, "max_model_len": self.config.max_model_len,
                "torch_threads": torch.get_num_threads()}


def build_policy_app(args: dict[str, Any]) -> serve.Application:
    """`serve run` entry: `import_path: app.policy:build_policy_app`, `args:` a PolicyConfig."""
    return Policy.bind(PolicyConfig.model_validate(args).model_dump())
