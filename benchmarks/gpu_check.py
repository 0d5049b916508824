"""One-shot GPU check: the project's update code on Qwen2.5-architecture models on one GPU, in one command, JSON out.

The GPU machine for such checks has torch, transformers and peft but no Ray and no vLLM, downloads nothing, and NCCL
refuses two ranks on one GPU. So this runs torch-level, and runs the project's own code where it can:
- the update (`actors.learner.rl_step`: behaviour log-probs, clipped surrogate, AdamW) on synthetic step records,
  under one-rank FSDP2 (per decoder layer, then the root, as `actors.trainer._load_model` shards; bf16
  MixedPrecisionPolicy on CUDA) with activation checkpointing (transformers' `gradient_checkpointing_enable`,
  non-reentrant, as the trainer enables it): median step seconds, peak memory, tokens/s;
- one LoRA step (peft, r=8 on q/k/v/o) through the same `rl_step`: seconds, trainable parameters, adapter bytes;
- the weight sync: the state dict packed in bf16 into buckets by `actors.weights.WeightPacker` (the format the
  replicas read), each bucket moved to the device once, then copied into a second model copy in this process and,
  through CUDA IPC, into one in a second process: seconds, bytes, and that each copy equals the source;
- the collective weight path's sender (`weight_sync.backend: nccl`; gloo on CPU): `actors.weights.send_weights` of
  the FSDP2 model's gathered parameters in bf16 buckets over a weight group built from a TCPStore, as Train rank
  0 sends them; one member only (NCCL refuses two ranks on one GPU), so this checks the group's construction on
  this torch build and times the on-device packing, not a transfer;
- transformers `generate` (greedy) on the copy that received the weights, as a stand-in engine: tokens/s.
Models are random-weight `Qwen2ForCausalLM`s built here (no hub): 0.5b and 1.5b on CUDA, `tiny` on CPU, where the
parts that need CUDA are recorded as skipped with the reason (the IPC path then runs over CPU shared memory).

    benchmarks/gpu_check.sh [--sizes 0.5b,1.5b] [--steps 5] [--seq-len 1024] [--batch 8] [--budget-s 420]
    python benchmarks/gpu_check.py --device cpu          # the CPU smoke run (tiny)

Writes --out (default benchmarks/results/gpu_check.json) after every part, so a run stopped by its budget or a
timeout leaves what it measured. Exits 1 when a part failed or a copy differs, 2 when the request needs CUDA that is
not there, 3 when the budget cut the run short.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import queue
import resource
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Qwen2.5-0.5B / -1.5B shapes (their config.json files), plus a CPU-sized one with the same structure (GQA, tied
# embeddings, q/k/v biases).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=1000),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
}
CPU_SIZES = ("tiny",)
CUDA_PARTS = "one-rank FSDP2 over NCCL, bf16 mixed precision, CUDA IPC and the 0.5b/1.5b sizes"
# Defaults per device: (steps, seq_len, batch, generation batches, new tokens, generation prompt length).
DEFAULTS = {"cuda": (5, 1024, 8, "16,64", 64, 128), "cpu": (2, 64, 4, "4", 8, 16)}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def needs_cuda(what: str) -> NoReturn:
    """The request needs CUDA that this machine does not have: exit 2 with a message, not a traceback."""
    print(f"gpu_check: {what} needs CUDA, and torch.cuda.is_available() is False here (torch {torch.__version__}, "
          f"CUDA build {torch.version.cuda}). CUDA is needed for {CUDA_PARTS}; on CPU run `--device cpu --sizes "
          "tiny`.", file=sys.stderr)
    sys.exit(2)


# ---- models and data --------------------------------------------------------------------------------------------
def qwen_config(size: str) -> dict[str, Any]:
    return dict(SIZES[size], max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def build_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> torch.nn.Module:
    """A random-weight Qwen2ForCausalLM, initialised on `device` (a 1.5B init on the host would take a minute)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with device:
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    return model.to(dtype)


def synthetic_rows(n: int, prompt_len: int, reply_len: int, vocab: int, seed: int = 0) -> dict[str, list]:
    """Step records as the Train job's shards hold them (`actors.trainer._rows`): prompt and reply ids, the
    engine's log-prob of each reply token, one advantage per row."""
    rng = np.random.default_rng(seed)
    return {"prompt_ids": rng.integers(2, vocab, size=(n, prompt_len)).tolist(),
            "response_ids": rng.integers(2, vocab, size=(n, reply_len)).tolist(),
            "rollout_logprobs": (-np.log(vocab) + 0.1 * rng.standard_normal((n, reply_len))).tolist(),
            "advantage": rng.standard_normal(n).tolist()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    # ru_maxrss (KiB on Linux) is the whole process's peak since it started: an upper bound for the part.
    return {"peak_rss_gib_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the update under one-rank FSDP2 ----------------------------------------------------------------------------
def start_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def fsdp_model(config: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """float32 master weights, activation checkpointing, FSDP2 per decoder layer then the root with bf16 compute
    on CUDA: what `actors.trainer._load_model` builds under `mixed_precision: bf16, activation_checkpointing: true`
    (that module imports Ray, so its few lines are repeated here rather than imported)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(config, device)
    model.train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def timed_rl_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: dict[str, list], steps: int,
                   device: torch.device, autocast_dtype: torch.dtype | None) -> tuple[list[float], dict[str, float]]:
    """`steps` calls of the project's `rl_step` (one optimizer step each: minibatch = all rows, one micro-batch),
    the seconds of each and the last step's metrics."""
    from actors.config import OptimConfig
    from actors.learner import Collective, rl_step

    n = len(rows["prompt_ids"])
    optim = OptimConfig(minibatch_size=n, micro_batch_size=n)
    rng = np.random.default_rng(0)
    seconds, metrics = [], {}
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        metrics = rl_step(model, optimizer, rows, optim, lr=1e-6, norm_length=len(rows["response_ids"][0]),
                          pad_id=0, device=device, rng=rng, collective=Collective.from_torch(),
                          autocast_dtype=autocast_dtype)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    if not all(np.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
        raise RuntimeError(f"non-finite step metrics: {metrics}")
    return seconds, metrics


def step_report(seconds: list[float], rows: dict[str, list], metrics: dict[str, float]) -> dict[str, Any]:
    measured = seconds[1:] or seconds  # the first step pays for kernel selection and allocator growth
    tokens = sum(len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"], strict=True))
    step_s = statistics.median(measured)
    return {"step_s": step_s, "step_s_all": seconds, "warmup_steps": len(seconds) - len(measured),
            "tokens_per_step": tokens, "tokens_per_s": tokens / step_s, "tokens_counted": "prompt + reply",
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "reply_tokens": metrics["tokens"]}


# ---- LoRA ------------------------------------------------------------------------------------------------------
def lora_step(config: dict[str, Any], rows: dict[str, list], device: torch.device) -> dict[str, Any]:
    """peft LoRA on a frozen base (bf16 on CUDA, with bf16 autocast as the trainer uses without FSDP2's policy),
    two `rl_step`s: the second is the figure, the first warms up."""
    import peft

    base = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    base.config.use_cache = False
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    reset_peak(device)
    seconds, metrics = timed_rl_steps(model, optimizer, rows, 2, device,
                                      torch.bfloat16 if device.type == "cuda" else None)
    return {"step_s": seconds[-1], "first_step_s": seconds[0], "trainable_params": sum(p.numel() for p in trainable),
            "total_params": sum(p.numel() for p in model.parameters()),
            "adapter_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "adapter_dtype": str(trainable[0].dtype), "loss": metrics["loss"], **peak_memory(device)}


# ---- the weight sync --------------------------------------------------------------------------------------------
def full_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor), FSDP2 shards gathered one parameter at a time, as `pack_model_weights` does: never a
    second whole copy of the model."""
    for name, value in model.state_dict().items():
        yield name, value.full_tensor() if hasattr(value, "full_tensor") else value


def device_views(buffer: torch.Tensor, entries, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one bucket already on the device, as views: `actors.weights.bucket_tensors`' layout, which
    reads numpy (the object store's bytes) and so cannot take a device buffer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return [(name, buffer[offset:offset + int(np.prod(shape, dtype=np.int64)) * itemsize].view(dtype).view(shape))
            for name, shape, offset in entries]


def load_buckets(params: dict[str, torch.Tensor], buckets: list[tuple[torch.Tensor, Any]]) -> None:
    """Copy each bucket's tensors into the model's state-dict tensors of the same name (a tied head twice)."""
    with torch.no_grad():
        for buffer, entries in buckets:
            for name, view in device_views(buffer, entries, torch.bfloat16):
                params[name].copy_(view)


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two exact integer sums of a bf16 tensor's bit patterns (plain, and weighted by position mod a prime), in
    chunks: equal tensors give equal pairs, and a changed or moved element changes them, across processes."""
    bits = t.detach().reshape(-1).view(torch.int16)
    plain = weighted = 0
    chunk = 1 << 24
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1
        plain += int(part.sum())
        weighted += int((part * pos).sum())
    return plain, weighted


def receive_weights(config: dict[str, Any], device: str, inbox: Any, outbox: Any) -> None:
    """The second process (an engine's stand-in): its own bf16 model copy; receives the buckets (CUDA IPC handles
    on CUDA, shared memory on CPU), copies them in, and reports when it finished and the copy's fingerprints."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        model = build_model(config, dev, torch.bfloat16, seed=1)  # other weights than the sender's
        params = model.state_dict()
        outbox.put(("ready", None))
        sent_at, buckets = inbox.get()
        received_at = time.monotonic()
        # torch's reductions hand over the memory (IPC handles, shared memory), not a pickled copy of the bytes
        shared = all(buffer.is_shared() for buffer, _ in buckets)
        load_buckets(params, buckets)
        sync(dev)
        done_at = time.monotonic()
        del buckets  # release the sender's memory before it frees it
        outbox.put(("done", {"seconds": done_at - sent_at, "receive_s": received_at - sent_at,
                             "copy_s": done_at - received_at, "received_shared": shared,
                             "fingerprints": {name: fingerprint(p) for name, p in params.items()}}))
    except BaseException:
        outbox.put(("error", traceback.format_exc(limit=6)))


def _await(outbox: Any, proc: Any, kind: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got, payload = outbox.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the receiving process exited (code {proc.exitcode}) before {kind!r}") from None
            continue
        if got == "error":
            raise RuntimeError(f"the receiving process failed:\n{payload}")
        return payload
    raise TimeoutError(f"the receiving process sent no {kind!r} within {timeout_s:.0f}s")


def transfer(model: torch.nn.Module, config: dict[str, Any], device: torch.device, bucket_bytes: int,
             ipc_timeout_s: float, skipped: Callable[[str, str], None]) -> tuple[dict[str, Any], torch.nn.Module]:
    """Pack in bf16 with the project's packer, move each bucket to the device once, copy into a second model copy
    here, and into one in a second process; the second copy is returned (generation runs on it)."""
    import torch.multiprocessing as mp

    from actors.weights import WeightPacker, bucket_tensors

    out: dict[str, Any] = {"dtype": "bfloat16", "bucket_bytes": bucket_bytes}
    if device.type != "cuda":
        skipped("cuda_ipc", "CUDA IPC needs CUDA; the same two-process path runs over CPU shared memory")
    reset_peak(device)
    # The receiver starts first: its start-up (imports, CUDA context, its model) is not part of a sync.
    ctx = mp.get_context("spawn")  # CUDA in a child process needs spawn
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receive_weights, args=(config, str(device), inbox, outbox), daemon=True)
    proc.start()
    finished = False
    try:
        # 1. Pack: gather, cast, copy to host buckets (`put` copies: the packer reuses its buffer).
        sync(device)
        t0 = time.perf_counter()
        packer = WeightPacker("bfloat16", bucket_bytes, put=np.copy)
        for name, full in full_state(model):
            packer.add(name, full)
        weights = packer.finish()
        out["pack_s"] = time.perf_counter() - t0
        del packer
        out.update(bytes=weights.nbytes, buckets=len(weights.buckets), tensors=len(weights.names))
        source = {name: full.detach().to(torch.bfloat16) for name, full in full_state(model)}
        # the project's reader (bucket_tensors) gives back the source, exactly
        out["packed_equal"] = all(torch.equal(t.to(device), source[name]) for b in weights.buckets
                                  for name, t in bucket_tensors(b.ref, b.entries, "bfloat16"))

        # 2. Each bucket to the device in one copy (on CPU: into shared memory, which the second process maps).
        t0 = time.perf_counter()
        if device.type == "cuda":
            buffers = [torch.from_numpy(b.ref).to(device) for b in weights.buckets]
        else:
            buffers = [torch.from_numpy(b.ref).clone().share_memory_() for b in weights.buckets]
        sync(device)
        out["upload_s"] = time.perf_counter() - t0
        out["upload"] = "host -> device, one copy per bucket (pageable memory)" if device.type == "cuda" \
            else "host -> shared memory, one copy per bucket (CPU: no device)"
        buckets = [(buffer, b.entries) for buffer, b in zip(buffers, weights.buckets, strict=True)]
        del weights, buffers  # the host buckets

        # 3. Into a second model copy in this process.
        target = build_model(config, device, torch.bfloat16, seed=1)
        params = target.state_dict()
        sync(device)
        t0 = time.perf_counter()
        load_buckets(params, buckets)
        sync(device)
        out["local_copy_s"] = time.perf_counter() - t0
        out["local_copy"] = "same-process device-to-device copy into a second bf16 model" if device.type == "cuda" \
            else "same-process CPU copy into a second bf16 model"
        out["local_copy_equal"] = all(torch.equal(params[name], t) for name, t in source.items())
        out["sync_s"] = out["pack_s"] + out["upload_s"] + out["local_copy_s"]

        # 4. Into a model copy in a second process (CUDA IPC: the receiver maps these very buffers). A failure
        #    here (a machine that forbids IPC) is recorded and keeps the figures above.
        method = "cuda_ipc" if device.type == "cuda" else "cpu_shared_memory"
        try:
            _await(outbox, proc, "ready", ipc_timeout_s)
            inbox.put((time.monotonic(), buckets))
            got = _await(outbox, proc, "done", ipc_timeout_s)
            finished = True
            expected = {name: fingerprint(t) for name, t in source.items()}
            out[method] = {"seconds": got["seconds"], "receive_s": got["receive_s"], "copy_s": got["copy_s"],
                           "received_shared": got["received_shared"], "equal": got["fingerprints"] == expected}
        except Exception as e:
            out[method] = {"error": f"{type(e).__name__}: {e}"[:2000], "equal": False}
        out[method]["what"] = ("buffers sent over torch.multiprocessing to a spawned process, copied into its own "
                               "bf16 model; equality by exact per-tensor fingerprints")
        out["equal"] = bool(out["packed_equal"] and out["local_copy_equal"] and out[method]["equal"])
        out.update(peak_memory(device))
        del buckets, source
        return out, target
    finally:
        proc.join(timeout=30 if finished else 0)  # a receiver still waiting for buckets would wait forever
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def weight_group_send(model: torch.nn.Module, device: torch.device, bucket_bytes: int) -> dict[str, Any]:
    """The sender's side of the collective weight path, on a group of one (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    from actors.weights import GroupSpec, join_group, leave_group, send_weights

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t0 = time.perf_counter()
    group = join_group(GroupSpec("gpu-check", "127.0.0.1", store.port, backend, 120.0), 0)
    join_s = time.perf_counter() - t0
    items = list(model.state_dict().items())
    sync(device)
    t0 = time.perf_counter()
    sent = send_weights(group, full_state(model), [(name, tuple(v.shape)) for name, v in items], "bfloat16",
                        bucket_bytes, "full", 1)
    sync(device)
    send_s = time.perf_counter() - t0
    leave_group()
    return {"backend": backend, "members": 1, "join_s": join_s, "send_s": send_s, **sent,
            "what": "actors.weights.send_weights: gathers, bf16 buckets packed on the group's device, broadcast "
                    "to a group of one (no receiver: NCCL refuses two ranks on one GPU)"}


# ---- generation -------------------------------------------------------------------------------------------------
def generation(model: torch.nn.Module, vocab: int, batches: list[int], prompt_len: int, new_tokens: int,
               device: torch.device) -> dict[str, Any]:
    """Greedy `generate` of `new_tokens` per row (exactly: no EOS is set, so nothing stops early): generated
    tokens per second per batch size, after a short warm-up."""
    model.eval()
    model.config.use_cache = True
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"dtype": str(next(model.parameters()).dtype), "prompt_len": prompt_len,
                           "new_tokens": new_tokens, "greedy": True}
    with torch.no_grad():
        for batch in batches:
            ids = torch.randint(2, vocab, (batch, prompt_len), generator=gen).to(device)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False)
            model.generate(ids, max_new_tokens=2, **kwargs)
            sync(device)
            t0 = time.perf_counter()
            result = model.generate(ids, max_new_tokens=new_tokens, **kwargs)
            sync(device)
            seconds = time.perf_counter() - t0
            generated = (result.shape[1] - prompt_len) * batch
            out[f"batch_{batch}"] = {"seconds": seconds, "generated_tokens": generated,
                                     "tokens_per_s": generated / seconds}
    out.update(peak_memory(device))
    return out


# ---- the run ----------------------------------------------------------------------------------------------------
class Check:
    """The report, written after every part; a part that would start past the budget is skipped, a failed part is
    recorded and the next one runs."""

    def __init__(self, out: Path, budget_s: float, report: dict[str, Any]):
        self.out, self.report = out, report
        self.started = time.monotonic()
        self.deadline = self.started + budget_s

    def skip(self, size: str, part: str, reason: str) -> None:
        self.report["skipped"].append({"size": size, "part": part, "reason": reason})
        self.write()

    def part(self, size: str, name: str, fn: Callable[[], Any]) -> Any:
        """fn's result dict under report["sizes"][size][name] (fn may also return (dict, value): value is
        returned), or None when skipped for the budget or failed."""
        if time.monotonic() > self.deadline:
            self.skip(size, name, f"time budget of {self.report['settings']['budget_s']:.0f}s spent")
            return None
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception as e:
            self.report["errors"].append({"size": size, "part": name, "error": f"{type(e).__name__}: {e}"[:2000],
                                          "traceback": traceback.format_exc(limit=8)[-4000:]})
            self.write()
            return None
        result, value = got if isinstance(got, tuple) else (got, None)
        result["part_s"] = time.perf_counter() - t0
        self.report["sizes"][size][name] = result
        self.write()
        return value

    def write(self) -> None:
        self.report["elapsed_s"] = time.monotonic() - self.started
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2) + "\n")


def check_size(check: Check, size: str, device: torch.device, args: argparse.Namespace) -> None:
    check.report["sizes"][size] = {}
    config = qwen_config(size)
    reply_len = max(1, args.seq_len // 4)  # agent records: long prompts, short replies
    rows = synthetic_rows(args.batch, args.seq_len - reply_len, reply_len, config["vocab_size"])
    state: dict[str, Any] = {}

    def fsdp_step() -> dict[str, Any]:
        model = state["model"] = fsdp_model(config, device)
        optimizer = state["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-6)
        reset_peak(device)
        seconds, metrics = timed_rl_steps(model, optimizer, rows, args.steps, device, autocast_dtype=None)
        return {"params": sum(p.numel() for p in model.parameters()), "rows": args.batch,
                "seq_len": args.seq_len, "reply_len": reply_len, "sharding": "FSDP2 fully_shard, 1 rank",
                "compute_dtype": "bfloat16 (MixedPrecisionPolicy)" if device.type == "cuda" else "float32",
                "activation_checkpointing": "transformers gradient_checkpointing_enable (use_reentrant=False)",
                "step": "actors.learner.rl_step: behaviour log-prob forward + forward/backward + AdamW",
                **step_report(seconds, rows, metrics), **peak_memory(device)}

    check.part(size, "fsdp_step", fsdp_step)
    state.pop("optimizer", None)  # Adam's moments: the largest share of memory, and the sync does not need them
    if device.type != "cuda":
        check.skip(size, "bf16_mixed_precision", "CUDA only here: on CPU the step computes in float32 over gloo")
    if "model" in state:
        check.part(size, "weight_group_send", lambda: weight_group_send(state["model"], device,
                                                                         args.bucket_mb * 2**20))
        target = check.part(size, "transfer", lambda: transfer(
            state["model"], config, device, args.bucket_mb * 2**20, args.ipc_timeout_s,
            lambda part, reason: check.skip(size, part, reason)))
        state.clear()
        free_memory(device)
        if target is not None:
            check.part(size, "generation", lambda: generation(
                target, config["vocab_size"], args.gen_batches, args.gen_prompt_len, args.new_tokens, device))
            del target
    else:
        check.skip(size, "transfer", "no trained model to send: fsdp_step did not run")
        check.skip(size, "generation", "no model copy to generate with: fsdp_step did not run")
    free_memory(device)
    if importlib.util.find_spec("peft") is None:
        check.skip(size, "lora_step", "peft is not importable in this environment")
    else:
        check.part(size, "lora_step", lambda: lora_step(config, rows, device))
    free_memory(device)


def package_version(name: str) -> str | None:
    """The installed version, or None when the package is not importable."""
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec(name) is None:
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return "importable, version unknown"


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": package_version("peft"),
           "ray": package_version("ray"), "vllm": package_version("vllm"), "cuda_build": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "device": str(device), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        env.update(device_name=props.name, device_memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}",
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, torch.device]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--sizes", default=None, help=f"comma-separated, of {list(SIZES)} (default: 0.5b,1.5b on "
                                                      "CUDA, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="rl_steps per size, the first a warm-up")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (a quarter of them reply)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step")
    parser.add_argument("--gen-batches", default=None, help="comma-separated generation batch sizes")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--gen-prompt-len", type=int, default=None)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=420.0, help="parts that would start later are skipped")
    parser.add_argument("--ipc-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "gpu_check.json")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        needs_cuda("--device cuda")
    device = torch.device("cuda", 0) if args.device != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    sizes = args.sizes.split(",") if args.sizes else (["0.5b", "1.5b"] if device.type == "cuda" else ["tiny"])
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; allowed: {list(SIZES)}")
    too_big = [s for s in sizes if device.type == "cpu" and s not in CPU_SIZES]
    if too_big:
        needs_cuda(f"size {','.join(too_big)} (on CPU only {', '.join(CPU_SIZES)} runs)")
    steps, seq_len, batch, gen_batches, new_tokens, gen_prompt_len = DEFAULTS[device.type]
    args.sizes = sizes
    args.steps = max(1, args.steps or steps)
    args.seq_len = max(2, args.seq_len or seq_len)
    args.batch = max(1, args.batch or batch)
    args.gen_batches = [int(b) for b in (args.gen_batches or gen_batches).split(",")]
    args.new_tokens = args.new_tokens or new_tokens
    args.gen_prompt_len = args.gen_prompt_len or gen_prompt_len
    return args, device


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, for the terminal."""
    out: dict[str, Any] = {"ok": report["ok"], "complete": report["complete"],
                           "device": report["environment"].get("device_name"),
                           "elapsed_s": round(report["elapsed_s"], 1)}
    for size, parts in report["sizes"].items():
        step, move, gen, lora = (parts.get(k, {}) for k in ("fsdp_step", "transfer", "generation", "lora_step"))
        ipc = move.get("cuda_ipc", move.get("cpu_shared_memory", {}))
        out[size] = {"step_s": step.get("step_s"), "tokens_per_s": step.get("tokens_per_s"),
                     "peak_gib": step.get("peak_memory_gib", step.get("peak_rss_gib_process")),
                     "sync_s": move.get("sync_s"), "ipc_s": ipc.get("seconds", ipc.get("error")),
                     "transfer_equal": move.get("equal"), "lora_step_s": lora.get("step_s"),
                     "gen_tokens_per_s": {k: v["tokens_per_s"] for k, v in gen.items() if k.startswith("batch_")}}
    out["skipped"] = [f"{s['size']}/{s['part']}" for s in report["skipped"]]
    out["errors"] = [f"{e['size']}/{e['part']}: {e['error'][:200]}" for e in report["errors"]]
    return out


def main(argv: list[str] | None = None) -> int:
    args, device = parse_args(argv)
    try:  # the update code needs a few small packages besides torch (the config schema's pydantic, the envs')
        import actors.learner  # noqa: F401
        import actors.weights  # noqa: F401
    except ModuleNotFoundError as e:
        raise SystemExit(f"gpu_check: the project's update code needs the Python package {e.name!r}, missing "
                         f"here (a small wheel: pip install {e.name})") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    report: dict[str, Any] = {"check": "gpu_check", "argv": sys.argv[1:] if argv is None else argv,
                              "environment": environment(device), "settings": settings, "sizes": {},
                              "skipped": [], "errors": []}
    check = Check(args.out, args.budget_s, report)
    if device.type != "cuda":
        check.skip("*", "nccl", "CUDA only: the one-rank process group uses gloo on CPU")
    start_process_group(device)
    try:
        for size in args.sizes:
            check_size(check, size, device, args)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()
    report["ok"] = not report["errors"] and all(r["transfer"]["equal"] for r in report["sizes"].values()
                                                 if "transfer" in r)
    report["complete"] = not any(s["reason"].startswith("time budget") for s in report["skipped"])
    check.write()
    print(json.dumps(summary(report), indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if not report["ok"] else 0 if report["complete"] else 3


if __name__ == "__main__":
    sys.exit(main())
