"""Loaded inside vLLM's worker process (`worker_extension_cls` of the async engine): the methods the Policy replica
calls through `collective_rpc` to stream a weight update into the engine one bucket at a time.

The async engine's model lives in another process, so a weights iterator cannot reach it as it does the in-process
engine (`reload_weights(weights_iterator=...)`). vLLM's in-place reload is split here across calls: `begin` restores
the layers to checkpoint form, each `load_bucket` loads the tensors of one bucket (raw bytes and their table, the
`actors.weights` format), and `finish` processes the layers back into the kernels' form. Only one bucket is held
in the worker at a time beyond the model itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def with_tied_head(tensors: Iterable[tuple[str, Any]], tied: bool) -> Iterator[tuple[str, Any]]:
    """The weights to feed vLLM's in-place reload. It does not keep a tied head tied: a new embedding alone leaves
    the head on the old one (log-probs off by ~1.5 nats after one perturbed update, measured). So a tied model gets
    its embedding as the head too, whether or not the sender included the head (a checkpoint stores it once)."""
    for name, tensor in tensors:
        if tied and name == HEAD:
            continue
        yield name, tensor
        if tied and name == EMBEDDING:
            yield HEAD, tensor


class WorkerExtension:
    """Mixed into vLLM's worker class: `self` is the worker (`self.model_runner`, `self.vllm_config`)."""

    def raygent_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def raygent_load_bucket(self, data: Any, entries: list[tuple[str, list[int], int]], dtype: str) -> int:
        import numpy as np
        from vllm.config import set_current_vllm_config

        from actors.weights import bucket_tensors

        tensors = bucket_tensors(np.frombuffer(data, dtype=np.uint8),
                                 [(name, tuple(shape), offset) for name, shape, offset in entries], dtype)
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(with_tied_head(tensors, tied))
        return len(entries)

    def raygent_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)

    def raygent_receive_weights(self, group: dict[str, Any], rank: int, version: int, dtype: str,
                                discard: bool) -> dict[str, Any]:
        """The collective path: this engine process is the replica's member of the weight group; each bucket is
        loaded into the model as it arrives (vLLM's layerwise in-place reload, begun once the header is here, and
        finished whatever happens, so that a later full update can reload the model again). Returns {"bytes"} or,
        on failure, {"error", "loading_began"} (an exception's type would not survive the RPC)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from actors.weights import TransferError, receive_into

        model = self.model_runner.get_model()
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))

        def load(header: dict[str, Any], tensors: Any, began: Any) -> None:
            if discard:
                for _ in tensors:
                    pass
                return
            with set_current_vllm_config(self.vllm_config):
                began()
                initialize_layerwise_reload(model)
                try:
                    model.load_weights(with_tied_head(tensors, tied))
                finally:
                    finalize_layerwise_reload(model, self.vllm_config.model_config)

        try:
            return {"bytes": receive_into(group, rank, version, dtype, load)}
        except TransferError as e:
            return {"error": str(e), "loading_began": e.loading_began}
