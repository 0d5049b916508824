"""How a model's weights travel from the Train job to the policy replicas (and to checkpoints): in the engine's
dtype (bf16 on GPU recipes: half of float32's bytes), in buckets of bounded size in Ray's object store.

The sender packs tensors one at a time into a bucket buffer and puts each full bucket, so it never holds a second
full copy of the model; a receiver fetches one bucket at a time and hands the engine zero-copy views of it, so it
holds at most one bucket beyond what the engine keeps. A bucket is raw bytes (numpy has no bfloat16) with a table
of (name, shape, byte offset) entries. `Weights` is small and picklable: it is what the controller keeps as the
latest weights and broadcasts; the bytes stay in the object store until the last `Weights` holding them is gone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import ray
    import torch

DTYPES = ("float32", "bfloat16", "float16")
_ALIGN = 64  # every tensor starts on a 64-byte boundary of its bucket (aligned views for any dtype)


@dataclass(frozen=True)
class WeightBucket:
    ref: ray.ObjectRef  # a flat uint8 numpy array
    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, byte offset) of each tensor in it
    nbytes: int


@dataclass(frozen=True)
class Weights:
    """A set of weights in the object store, as buckets of one dtype: the full model (`kind` "full") or a LoRA
    adapter under peft's names (`kind` "adapter", actors/lora.py)."""

    buckets: tuple[WeightBucket, ...]
    dtype: str
    nbytes: int
    kind: str = "full"

    @property
    def names(self) -> list[str]:
        return [name for b in self.buckets for name, _, _ in b.entries]

    def tensors(self, timeout_s: float = 300.0) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every weight, fetching one bucket at a time; the tensors are read-only views of the
        object store's copy (on the replica's node), alive as long as a tensor of the bucket is."""
        import ray

        for bucket in self.buckets:
            yield from bucket_tensors(ray.get(bucket.ref, timeout=timeout_s), bucket.entries, self.dtype)

    def state_dict(self, timeout_s: float = 300.0) -> dict[str, torch.Tensor]:
        """All weights as a dict of views (no copy): for writing a model folder."""
        return dict(self.tensors(timeout_s))


def bucket_tensors(data: np.ndarray, entries: Iterable[tuple[str, tuple[int, ...], int]],
                   dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one bucket's bytes, as views (no copy)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    with warnings.catch_warnings():  # read-only memory: inference never writes to its weights
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(data)
    for name, shape, offset in entries:
        count = int(np.prod(shape, dtype=np.int64))
        yield name, raw[offset:offset + count * itemsize].view(torch_dtype).view(shape)


class WeightPacker:
    """Packs tensors, in the order given, into buckets of at most `bucket_bytes` (a tensor larger than that travels
    alone in its own bucket) and puts each full bucket in the object store (`ray.put` unless `put` is given: the
    bucket buffer is reused, so `put` must copy)."""

    def __init__(self, dtype: str, bucket_bytes: int, put: Callable[[Any], ray.ObjectRef] | None = None,
                 kind: str = "full"):
        if dtype not in DTYPES:
            raise ValueError(f"weights dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        if put is None:  # imported here, not at the top: packing without Ray (the GPU check) needs no Ray
            import ray

            put = ray.put
        self.dtype, self.bucket_bytes, self.put, self.kind = dtype, int(bucket_bytes), put, kind
        self.buckets: list[WeightBucket] = []
        self._buffer = np.empty(0, dtype=np.uint8)
        self._entries: list[tuple[str, tuple[int, ...], int]] = []
        self._used = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        data = tensor.detach().to(device="cpu", dtype=getattr(torch, self.dtype)).contiguous().view(-1).view(torch.uint8)
        size = data.numel()
        start = -(-self._used // _ALIGN) * _ALIGN
        if self._entries and start + size > self.bucket_bytes:
            self._flush()
            start = 0
        if start + size > len(self._buffer):  # the first bucket, or a tensor larger than a bucket (here start is 0)
            self._buffer = np.empty(max(self.bucket_bytes, size), dtype=np.uint8)
        self._buffer[start:start + size] = data.numpy()
        self._entries.append((name, tuple(tensor.shape), start))
        self._used = start + size

    def _flush(self) -> None:
        if self._entries:
            self.buckets.append(WeightBucket(self.put(self._buffer[:self._used]), tuple(self._entries), self._used))
        self._entries, self._used = [], 0

    def finish(self) -> Weights:
        self._flush()
        self._buffer = np.empty(0, dtype=np.uint8)
        return Weights(tuple(self.buckets), self.dtype, sum(b.nbytes for b in self.buckets), self.kind)


def pack_weights(tensors: Iterable[tuple[str, torch.Tensor | np.ndarray]], dtype: str, bucket_bytes: int,
                 kind: str = "full") -> Weights:
    """Weights from (name, tensor or array) pairs, e.g. a state dict's items or a model folder's arrays."""
    import torch

    packer = WeightPacker(dtype, bucket_bytes, kind=kind)
    for name, value in tensors:
        packer.add(name, torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) else value)
    return packer.finish()
