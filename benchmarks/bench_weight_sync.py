"""Weight sync from the Train job to the policy replicas: the previous way vs bucketed, measured in one run.

For a ~10M- and a ~100M-parameter model (the shapes of bench_policy's broadcast): the sender is two Ray actors
holding the model under FSDP2 (gloo), as the Train job's ranks do; the receivers are two Ray actors each owning a
vLLM engine, as Policy replicas do. Variants:
- `full` (raygent before actors/weights.py): `get_model_state_dict(full_state_dict=True, cpu_offload=True)` gathers
  the whole model on rank 0 as float32 numpy arrays, one `ray.put`, each receiver fetches the dict and loads it;
- `bucketed` float32 and bfloat16: `pack_model_weights` gathers one parameter at a time into buckets of
  `--bucket-mb` in the object store; each receiver streams them into its engine (`Weights.tensors()`); the
  receivers' engines are in that dtype;
- `adapter` float32 (a LoRA run, `--lora-rank` on every linear layer of the decoder): the senders hold the model
  with its adapter and pack the adapter alone; each receiver writes it as an adapter folder and swaps it into its
  vLLM engine (LoRA enabled), as a Policy replica does;
- `gloo` float32 / bfloat16 (`weight_sync.backend: gloo`, the CPU twin of nccl): no object store; rank 0 broadcasts
  the same buckets over a weight group whose other members are the receivers, each loading every bucket into its
  engine as it arrives (`send_model_weights`, `receive_into`), as the Train job and the Policy replicas do.
Reported per variant: seconds per sync (sender + both receivers; median of repeats after a warm-up), the peak
memory the sync adds to rank 0 and to a receiver (ru_maxrss of fresh processes, measured over their first sync:
exact peaks; the object-store pages a process writes or reads count in both variants alike), and the bytes sent.
Writes benchmarks/results/bench_weight_sync.json.

    python benchmarks/bench_weight_sync.py [--repeats 3] [--bucket-mb 64] [--sizes 10M 100M]
    python benchmarks/bench_weight_sync.py --variants bucketed_float32 adapter_float32 --out bench_weight_sync_lora
    python benchmarks/bench_weight_sync.py --variants bucketed_float32 gloo_float32 bucketed_bfloat16 gloo_bfloat16 \
        --out bench_weight_sync_gloo
    python benchmarks/bench_weight_sync.py --sizes smollm2-135m --variants bucketed_float32 gloo_float32 \
        bucketed_bfloat16 gloo_bfloat16 adapter_float32 --out bench_weight_sync_smollm2-135m
Every run also times the floor: the first variant's bytes put once and copied by 2 plain actors (`raw_copy`), and
each variant's ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
RESULTS = REPO_ROOT / "benchmarks" / "results"


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["10M", "100M"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=["full_float32", "bucketed_float32", "bucketed_bfloat16"],
                        help="of full_float32, bucketed_float32, bucketed_bfloat16, adapter_float32, gloo_float32, "
                             "gloo_bfloat16")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", default="bench_weight_sync", help="the results file's name, under results/")
    args = parser.parse_args()

    import numpy as np
    import ray
    import torch

    from actors.config import LoraConfig
    from actors.lora import write_adapter
    from actors.trainer import pack_model_weights
    from app.default_model import build_default_model, resolve_model
    from app.engines import make_engine
    from benchmarks.bench_policy import BROADCAST_MODELS
    from benchmarks.serve_process import free_port

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    bucket_bytes = args.bucket_mb * 2**20

    @ray.remote(num_cpus=0.5)
    class Rank:
        """One FSDP2 rank of the sender (rank 0 puts what it packs in the object store)."""

        def __init__(self, model_path: str, rank: int, port: int, lora: dict[str, Any] | None):
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            from actors.trainer import _load_model

            torch.set_num_threads(1)
            self.rank = rank
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            self.model = _load_model(model_path, torch.device("cpu"), "fsdp", init_device_mesh("cpu", (2,)),
                                     {"lora": lora}, trainable=True)
            self.kept: Any = None

        def params(self) -> int:
            return sum(p.numel() for p in self.model.parameters())

        def send(self, variant: str, dtype: str, group: dict[str, Any] | None = None,
                 version: int = 0) -> dict[str, Any]:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            from actors.trainer import send_model_weights

            self.kept = None
            before, started = peak_mib(), time.perf_counter()
            if variant == "gloo":  # over the weight group: nothing in the object store
                sent = send_model_weights(self.model, "fsdp", dtype, bucket_bytes, self.rank, group, version)
                assert "send_error" not in sent, sent
            elif variant == "full":  # the previous path, as actors/trainer.py had it
                sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
                state = {k: v.detach().float().cpu().numpy() for k, v in sd.items()}
                sent = [ray.put(state)] if self.rank == 0 else None
                del sd, state
            else:
                sent = pack_model_weights(self.model, "fsdp", dtype, bucket_bytes, self.rank,
                                          adapter_only=variant == "adapter")
            self.kept = sent
            return {"sent": sent, "seconds": time.perf_counter() - started, "peak_added_mib": peak_mib() - before}

    @ray.remote(num_cpus=0.5)
    class RawReceiver:
        """The floor: a plain copy of the same bytes out of the object store, no model, no engine."""

        def take(self, refs: list[Any]) -> float:
            started = time.perf_counter()
            copies = [np.array(x, copy=True) for x in ray.get(refs)]
            del copies
            return time.perf_counter() - started

    @ray.remote(num_cpus=0.5)
    class Receiver:
        def __init__(self, model_path: str, dtype: str, lora: dict[str, Any] | None):
            torch.set_num_threads(1)
            self.dtype = dtype
            self.lora = LoraConfig(**lora) if lora else None
            self.engine = make_engine("vllm", model_path, dtype=dtype, max_model_len=256, kv_cache_bytes=32 * 2**20,
                                      lora=self.lora)

        def take(self, sent: Any, group: dict[str, Any] | None = None, rank: int = 0,
                 version: int = 0) -> dict[str, Any]:
            from actors.weights import receive_into

            before, started = peak_mib(), time.perf_counter()
            if group is not None:  # a member of the weight group: each bucket into the engine as it arrives
                receive_into(group, rank, version, self.dtype,
                             lambda header, tensors, began: (began(), self.engine.load_weights(tensors)))
            elif isinstance(sent, list):  # the previous path: the whole dict fetched, then loaded
                state = ray.get(sent[0])
                self.engine.load_weights([(k, torch.from_numpy(v)) for k, v in state.items()])
                del state
            elif sent.kind == "adapter":  # as Policy._load_adapter: a folder on this node, swapped in
                folder = tempfile.mkdtemp(prefix="bench-adapter-")
                write_adapter(folder, sent.state_dict(), self.lora)
                self.engine.load_adapter(folder)
            else:
                self.engine.load_weights(sent.tensors())
            return {"seconds": time.perf_counter() - started, "peak_added_mib": peak_mib() - before}

    store = None

    def weight_group(receivers: int) -> dict[str, Any]:
        """A weight group hosted here (as the controller hosts it): rank 0 the sender, then the receivers."""
        import uuid

        import torch.distributed as dist

        from actors.weights import GroupSpec

        nonlocal store
        if store is None:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return GroupSpec(f"bench-{uuid.uuid4().hex[:6]}", "127.0.0.1", store.port, "gloo", 300.0,
                         {f"receiver-{k}": k for k in range(1, receivers + 1)}).to_dict()

    def sent_size(variant: str, sent: Any, dtype: str, bucket: int) -> dict[str, int]:
        if variant == "full":
            return {"bytes": sum(v.nbytes for v in ray.get(sent[0]).values()), "buckets": 1}
        if variant == "gloo":
            return {"bytes": sent["sent_bytes"], "buckets": sent["sent_buckets"]}
        return {"bytes": sent.nbytes, "buckets": len(sent.buckets)}

    results: dict[str, Any] = {"bucket_mb": args.bucket_mb, "repeats": args.repeats, "receivers": 2,
                               "engine": "vllm", "machine_cpus": os.cpu_count()}
    for size in args.sizes:
        model_path = str(build_default_model(BROADCAST_MODELS[size])) if size in BROADCAST_MODELS \
            else resolve_model(size)  # a built-in model by name, e.g. smollm2-135m
        out: dict[str, Any] = {}
        params = 0
        for name in args.variants:
            variant, dtype = name.split("_")
            lora = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank} if variant == "adapter" else None
            port = free_port()  # fresh processes per variant: their first sync's peak is the variant's own
            ranks = [Rank.remote(model_path, r, port, lora) for r in range(2)]
            receivers = [Receiver.remote(model_path, dtype, lora) for _ in range(2)]
            params = ray.get(ranks[0].params.remote())  # a DTensor counts its global elements
            ray.get([r.__ray_ready__.remote() for r in receivers])
            group = weight_group(len(receivers)) if variant == "gloo" else None
            runs = []
            for version in range(1, args.repeats + 2):
                started = time.perf_counter()
                if group is not None:  # sender and receivers at once: they meet in the broadcasts
                    sending = [r.send.remote(variant, dtype, group, version) for r in ranks]
                    took = ray.get([r.take.remote(None, group, k, version) for k, r in enumerate(receivers, 1)])
                    sent = ray.get(sending)
                else:
                    sent = ray.get([r.send.remote(variant, dtype) for r in ranks])
                    took = ray.get([r.take.remote(sent[0]["sent"]) for r in receivers])
                runs.append({"sync_s": time.perf_counter() - started, "sender_s": sent[0]["seconds"],
                             "receiver_s": max(t["seconds"] for t in took),
                             "rank0_peak_added_mib": sent[0]["peak_added_mib"],
                             "receiver_peak_added_mib": max(t["peak_added_mib"] for t in took),
                             **sent_size(variant, sent[0]["sent"], dtype, bucket_bytes)})
                del sent
            timed = runs[1:]  # the first sync warms up; its peaks are the processes' first (exact) ones
            out[name] = {"sync_s": statistics.median(r["sync_s"] for r in timed),
                         "sender_s": statistics.median(r["sender_s"] for r in timed),
                         "receiver_s": statistics.median(r["receiver_s"] for r in timed),
                         "rank0_peak_added_mib": runs[0]["rank0_peak_added_mib"],
                         "receiver_peak_added_mib": runs[0]["receiver_peak_added_mib"],
                         "bytes": runs[0]["bytes"], "buckets": runs[0]["buckets"], "runs": runs}
            print(f"[{size}] {name}: {out[name]['sync_s']:.2f} s per sync, {out[name]['bytes'] / 2**20:.0f} MiB "
                  f"in {out[name]['buckets']} bucket(s); peak added: rank 0 +{out[name]['rank0_peak_added_mib']:.0f}"
                  f" MiB, receiver +{out[name]['receiver_peak_added_mib']:.0f} MiB", flush=True)
            for actor in [*ranks, *receivers]:
                ray.kill(actor)
        # the floor: the first variant's bytes put once and copied by 2 receivers (median of repeats)
        raw_receivers = [RawReceiver.remote() for _ in range(2)]
        blob_bytes, raw = out[args.variants[0]]["bytes"], []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            refs = [ray.put(np.ones(blob_bytes, dtype=np.uint8))]
            ray.get([r.take.remote(refs) for r in raw_receivers])
            raw.append(time.perf_counter() - started)
            del refs
        out["raw_copy"] = {"sync_s": statistics.median(raw[1:]), "bytes": blob_bytes}
        for name in args.variants:
            out[name]["sync_s_ratio_to_raw_copy"] = out[name]["sync_s"] / out["raw_copy"]["sync_s"]
        print(f"[{size}] raw copy of {blob_bytes / 2**20:.0f} MiB to 2 receivers: {out['raw_copy']['sync_s']:.2f} s",
              flush=True)
        # ratios to the first variant of the run (the previous way, or the full weights beside an adapter)
        first = out[args.variants[0]]
        for name in args.variants[1:]:
            out[name]["sync_s_ratio_to_first"] = out[name]["sync_s"] / first["sync_s"]
            out[name]["bytes_ratio_to_first"] = out[name]["bytes"] / first["bytes"]
            out[name]["rank0_peak_ratio_to_first"] = (out[name]["rank0_peak_added_mib"]
                                                      / max(1e-9, first["rank0_peak_added_mib"]))
        results[size] = {"params": params, **out}
    ray.shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote benchmarks/results/{args.out}.json")


if __name__ == "__main__":
    main()
