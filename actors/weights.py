"""How a model's weights travel from the Train job to the policy replicas (and to checkpoints): in the engine's
dtype (bf16 on GPU recipes: half of float32's bytes), in buckets of bounded size in Ray's object store.

The sender packs tensors one at a time into a bucket buffer and puts each full bucket, so it never holds a second
full copy of the model; a receiver fetches one bucket at a time and hands the engine zero-copy views of it, so it
holds at most one bucket beyond what the engine keeps. A bucket is raw bytes (numpy has no bfloat16) with a table
of (name, shape, byte offset) entries. `Weights` is small and picklable: it is what the controller keeps as the
latest weights and broadcasts; the bytes stay in the object store until the last `Weights` holding them is gone.

The collective path (`weight_sync.backend: gloo | nccl`) sends the same buckets over a torch process group instead:
Train rank 0 is the group's rank 0 and broadcasts a header (the bucket table), then each bucket; every replica's
engine process is a member and loads each bucket as it arrives. Nothing goes through the object store. A group is
a `GroupSpec` (a TCPStore that the controller hosts, the members' ranks); each process joins one group at a time.
"""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
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

    with warnings.catch_warnings():  # read-only memory: inference never writes to its weights
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(data)
    return views_of(raw, entries, dtype)


def views_of(raw: torch.Tensor, entries: Iterable[tuple[str, tuple[int, ...], int]],
             dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in a flat uint8 buffer (on any device), as views of it."""
    import torch

    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    for name, shape, offset in entries:
        count = int(np.prod(shape, dtype=np.int64))
        yield name, raw[offset:offset + count * itemsize].view(torch_dtype).view(tuple(shape))


def _itemsize(dtype: str) -> int:
    return np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize


class _BucketFiller:
    """Where each tensor goes: the next 64-byte-aligned offset of the current bucket, or a new bucket when it would
    overflow `bucket_bytes` (a tensor larger than a bucket travels alone)."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes, self.used, self.count = int(bucket_bytes), 0, 0

    def place(self, size: int) -> tuple[bool, int]:
        """(whether the current bucket closes before this tensor, its offset in its bucket)."""
        start = -(-self.used // _ALIGN) * _ALIGN
        new_bucket = self.count > 0 and start + size > self.bucket_bytes
        if new_bucket:
            start, self.count = 0, 0
        self.used, self.count = start + size, self.count + 1
        return new_bucket, start


def bucket_layout(shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: str,
                  bucket_bytes: int) -> list[tuple[list[tuple[str, tuple[int, ...], int]], int]]:
    """The buckets that tensors of these names and shapes fill, in order, as `WeightPacker` fills them: each
    bucket's (name, shape, byte offset) entries and its size. Computed from shapes alone (an FSDP2 parameter's
    global shape), so a sender can announce the table before it gathers anything."""
    filler, buckets = _BucketFiller(bucket_bytes), []
    for name, shape in shapes:
        size = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
        new_bucket, start = filler.place(size)
        if new_bucket or not buckets:
            buckets.append(([], 0))
        buckets[-1][0].append((name, tuple(int(d) for d in shape), start))
        buckets[-1] = (buckets[-1][0], start + size)
    return buckets


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
        self._filler = _BucketFiller(bucket_bytes)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        data = tensor.detach().to(device="cpu", dtype=getattr(torch, self.dtype)).contiguous().view(-1).view(torch.uint8)
        size = data.numel()
        new_bucket, start = self._filler.place(size)
        if new_bucket:
            self._flush()
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


# ---- the collective path: a torch process group from Train rank 0 to every replica's engine ----------------------
GROUP_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupSpec:
    """A weight group: where its members meet (a TCPStore the controller hosts; `id` prefixes the group's keys) and
    who is which rank (Train rank 0 is rank 0, the sender; `ranks` maps each replica to its rank). Plain data: it
    travels to the members as a dict (`asdict`)."""

    id: str
    host: str
    port: int
    backend: str
    timeout_s: float
    ranks: dict[str, int] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.ranks) + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_device(backend: str) -> torch.device:
    """Where a member's buffers live: this process's GPU under NCCL (which only moves GPU memory), else the CPU.
    NCCL without a GPU or a torch built without NCCL is refused with what to change."""
    import torch
    import torch.distributed as dist

    if backend == "gloo":
        return torch.device("cpu")
    if backend != "nccl":
        raise ValueError(f"weight_sync.backend {backend!r}; allowed: object_store, {', '.join(GROUP_BACKENDS)}")
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise RuntimeError("weight_sync.backend 'nccl' sends weights from GPU to GPU, but this process has no CUDA "
                           "device (or torch has no NCCL): give the Train workers (trainer.use_gpu) and the Policy "
                           "replicas (num_gpus) GPUs, or use weight_sync.backend 'object_store' or 'gloo'")
    return torch.device("cuda", torch.cuda.current_device())


class WeightGroup:
    """This process's membership of one weight group: a torch process group of its own, built from the TCPStore
    (not the default group: a Train worker's default group is its FSDP group, and a replica has none).

    Every operation has a deadline of the group's `timeout_s`: first a barrier in the store (all members arrived,
    or TimeoutError; NCCL would otherwise wait in its communicator set-up for a member that never comes), then each
    broadcast. Under gloo the broadcast's own timeout raises; under NCCL, whose wait only orders the GPU stream,
    the CPU polls the operation until the deadline and aborts the communicator past it (NCCL's watchdog, which
    would end the whole process, is given twice as long)."""

    def __init__(self, spec: GroupSpec, rank: int):
        import torch.distributed as dist

        self.id, self.rank, self.backend, self.timeout_s = spec.id, rank, spec.backend, spec.timeout_s
        self.device = group_device(spec.backend)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.PrefixStore(spec.id, dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout))
        if store.add("arrived", 1) == spec.world:
            store.set("all", "1")
        store.wait(["all"], timeout)  # raises past the timeout: a member did not come
        if spec.backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, spec.world, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = 2 * timeout
            self.group = dist.ProcessGroupNCCL(store, rank, spec.world, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From rank 0 to every member, in place, done when this returns; raises on every member when one is
        missing past the timeout."""
        import time

        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.group.broadcast([tensor], options)
        if self.backend == "gloo":
            work.wait()
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"an NCCL broadcast of the weight group did not finish within {self.timeout_s}s")
            time.sleep(0.001)

    def close(self) -> None:
        """Give the group's connections up now (an NCCL communicator is aborted: its state after a failure is
        unknown), rather than when the object is collected."""
        try:
            if self.backend == "nccl":
                self.group.abort()
            else:
                self.group.shutdown()
        except Exception:  # already gone, or a torch without the call: collection frees it
            pass


_joined: WeightGroup | None = None  # the group this process is a member of (one at a time)


def join_group(spec: GroupSpec | dict[str, Any], rank: int) -> WeightGroup:
    """This process's member of `spec` (rank `rank`): the one it joined before, or a new one (its rendezvous waits
    for every member). Joining another group leaves the previous one."""
    global _joined
    spec = spec if isinstance(spec, GroupSpec) else GroupSpec(**spec)
    if _joined is None or _joined.id != spec.id or _joined.rank != rank:
        leave_group()
        _joined = WeightGroup(spec, rank)
    return _joined


def leave_group() -> None:
    """After a failed transfer: the group's state is unknown, so the next transfer forms a new one."""
    global _joined
    if _joined is not None:
        _joined.close()
    _joined = None


def send_weights(group: WeightGroup, tensors: Iterable[tuple[str, torch.Tensor]], shapes: list[tuple[str, tuple]],
                 dtype: str, bucket_bytes: int, kind: str, version: int) -> dict[str, int]:
    """Rank 0's side: the header (the bucket table, dtype, kind, version), then each bucket, packed from `tensors`
    (in the order of `shapes`) in `dtype` on the group's device. Returns the bytes and buckets sent."""
    import torch

    layout = bucket_layout(shapes, dtype, bucket_bytes)
    header = json.dumps({"dtype": dtype, "kind": kind, "version": version, "buckets": layout}).encode()
    group.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=group.device))
    group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
    torch_dtype, pending = getattr(torch, dtype), iter(tensors)
    for entries, nbytes in layout:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        for name, _, offset in entries:
            got, tensor = next(pending)
            if got != name:
                raise RuntimeError(f"weights out of order: {got!r} where the header announced {name!r}")
            data = tensor.detach().to(device=group.device, dtype=torch_dtype).contiguous().view(-1).view(torch.uint8)
            buffer[offset:offset + data.numel()].copy_(data)
        group.broadcast(buffer)
    return {"bytes": sum(nbytes for _, nbytes in layout), "buckets": len(layout)}


def receive_weights(group: WeightGroup) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """A member's side: the header now, then (name, tensor) for every weight, receiving one bucket at a time as the
    iterator is read (each bucket a new buffer: the tensors are views of it and may be kept)."""
    import torch

    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(size)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(raw)
    header = json.loads(bytes(raw.cpu().numpy()))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for entries, nbytes in header["buckets"]:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
            group.broadcast(buffer)
            yield from views_of(buffer, entries, header["dtype"])

    return header, tensors()


class TransferError(RuntimeError):
    """A collective transfer that failed; `loading_began`: whether the engine had started to load it (then its
    weights are half old, half new, and it must not serve)."""

    def __init__(self, message: str, loading_began: bool):
        super().__init__(message)
        self.loading_began = loading_began


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def receive_into(group: GroupSpec | dict[str, Any], rank: int, version: int, dtype: str,
                 load: Callable[[dict[str, Any], Iterator[tuple[str, torch.Tensor]], Callable[[], None]], None]) -> int:
    """A member's whole transfer: join `group` as `rank`, read the header (it must announce `version` and `dtype`,
    the engine's), then `load(header, tensors, began)` reads the tensors as they arrive and calls `began()` just
    before it first writes to the engine. Any failure leaves the group (the next transfer forms a new one) and
    raises `TransferError`, saying whether the engine had been written to. Returns the bytes received."""
    try:
        header, tensors = receive_weights(join_group(group, rank))
    except Exception as e:
        leave_group()
        raise TransferError(_why(e), False) from e
    wrong = (f"the sender sent version {header['version']}, not {version}" if header["version"] != version else
             f"weights in {header['dtype']} for an engine in {dtype}" if header["dtype"] != dtype else None)
    written = [False]
    try:
        if wrong:  # read all the same: the sender waits for every member
            for _ in tensors:
                pass
            raise ValueError(wrong)
        load(header, tensors, lambda: written.__setitem__(0, True))
    except Exception as e:
        leave_group()
        raise TransferError(_why(e), written[0]) from e
    return sum(nbytes for _, nbytes in header["buckets"])
