"""Shared by the update tests: a small random Qwen2 model saved once, rows that exercise every masking path, the
full gradient of a model (FSDP2 shards gathered), and the worker that runs one rank of a 2-rank FSDP2 update over
gloo (started with torch.multiprocessing, not Ray Train, to keep the test fast)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 48


def build_model(folder: Path, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (folder / "config.json").exists():
        return folder
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def load_model(folder: Path | str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def make_rows(n: int, seed: int = 0, perturb: float = 0.3) -> dict[str, list]:
    """Rows with prompts and replies of varied lengths, advantages of both signs and rollout log-probs that differ
    from any model's (so ratios, clipping and the mismatch weights are all exercised)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, VOCAB, size=rng.integers(2, 12)).tolist() for _ in range(n)]
    replies = [rng.integers(2, VOCAB, size=rng.integers(1, 7)).tolist() for _ in range(n)]
    logprobs = [(-np.log(VOCAB) + perturb * rng.standard_normal(len(r))).tolist() for r in replies]
    advantages = rng.standard_normal(n).round(3).tolist()
    return {"prompt_ids": prompts, "response_ids": replies, "rollout_logprobs": logprobs, "advantage": advantages}


def make_conversation_rows(n: int, seed: int = 0, perturb: float = 0.3) -> dict[str, list]:
    """Conversation rows (actors/conversation.py): replies of 2-4 turns with env tokens between them (mask 0, log-prob
    0, as the runner writes them), each turn its own advantage; every other row is a one-turn row (mask all 1), so
    one batch mixes both kinds."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "rollout_logprobs", "advantage",
                                              "loss_mask", "token_advantages")}
    for i in range(n):
        turns = 1 if i % 2 else int(rng.integers(2, 5))
        ids, mask, logp, adv = [], [], [], []
        for t in range(turns):
            if t:
                env = int(rng.integers(1, 5))
                ids += rng.integers(2, VOCAB, size=env).tolist()
                mask += [0] * env
                logp += [0.0] * env
                adv += [0.0] * env
            k, a = int(rng.integers(1, 5)), round(float(rng.standard_normal()), 3)
            ids += rng.integers(2, VOCAB, size=k).tolist()
            mask += [1] * k
            logp += (-np.log(VOCAB) + perturb * rng.standard_normal(k)).tolist()
            adv += [a] * k
        rows["prompt_ids"].append(rng.integers(2, VOCAB, size=rng.integers(2, 8)).tolist())
        rows["response_ids"].append(ids)
        rows["rollout_logprobs"].append(logp)
        rows["advantage"].append(float(np.mean([a for a, m in zip(adv, mask, strict=True) if m])))
        rows["loss_mask"].append(mask)
        rows["token_advantages"].append(adv)
    return rows


def take(rows: dict[str, list], idx) -> dict[str, list]:
    return {k: [v[i] for i in idx] for k, v in rows.items()}


def full_gradient(model) -> torch.Tensor:
    """Every parameter's gradient, flattened in parameter order (FSDP2 DTensor shards gathered)."""
    parts = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            g = torch.zeros_like(p.full_tensor() if hasattr(p, "full_tensor") else p)
        elif hasattr(g, "full_tensor"):
            g = g.full_tensor()
        parts.append(g.detach().reshape(-1).float())
    return torch.cat(parts)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def gradient_of(model, ref, rows, optim_kwargs: dict[str, Any], *, collective=None, autocast_dtype=None):
    """The gradient and metrics of one minibatch holding all `rows` (no optimizer step)."""
    from actors.config import OptimConfig
    from actors.learner import ALONE, rl_step

    optim = OptimConfig(**{"minibatch_size": 10_000, **optim_kwargs})
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = rl_step(model, opt, rows, optim, lr=0.0, norm_length=8, pad_id=0, device="cpu",
                      rng=np.random.default_rng(0), collective=collective or ALONE, ref_model=ref,
                      autocast_dtype=autocast_dtype, optimizer_steps=False)
    return full_gradient(model), metrics


def fsdp_rank(rank: int, world: int, port: int, folder: str, ref_folder: str, rows: dict[str, list],
              splits: list[list[int]], cases: list[dict[str, Any]], out: str) -> None:
    """One rank: FSDP2 over gloo, policy and reference sharded per layer, each case's gradient (gathered) and
    metrics saved by rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from actors.learner import Collective
    from actors.trainer import _load_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = []
        for case in cases:
            cfg = {"mixed_precision": case.get("mixed_precision", "fp32")}
            model = _load_model(folder, torch.device("cpu"), "fsdp", mesh, cfg, trainable=True)
            ref = _load_model(ref_folder, torch.device("cpu"), "fsdp", mesh, cfg, trainable=False) \
                if case["optim"].get("kl_coef", 0) > 0 else None
            grad, metrics = gradient_of(model, ref, take(rows, splits[rank]), case["optim"],
                                        collective=Collective.from_torch())
            results.append({"grad": grad, "metrics": metrics})
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_parameters(model) -> torch.Tensor:
    """Every parameter, flattened in parameter order (FSDP2 shards gathered: a collective)."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).float()
                      for p in model.parameters()])


@contextlib.contextmanager
def rank_mesh(rank: int, world: int, port: int | None):
    """This process as rank `rank` of a gloo group of `world` and its FSDP2 mesh; with `port` None a lone process
    without a group (mesh None)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if port is None:
        yield None
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def steps_with_train_state(rank: int, world: int, port: int | None, folder: str, rows: dict[str, list],
                           splits: list[list[int]], steps_before: int, save_dir: str | None, load_dir: str | None,
                           out: str) -> None:
    """One rank (or, with `port` None, a lone process without a process group) of: the model of `folder` and a
    fresh AdamW, the Train job's sharded state loaded from `load_dir` if given, `steps_before` RL steps, the state
    saved to `save_dir` if given, one more step; rank 0 saves the full parameters after it to `out`."""
    from actors.config import OptimConfig
    from actors.learner import ALONE, Collective, rl_step
    from actors.trainer import _load_model, load_train_state, save_train_state

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with rank_mesh(rank, world, port) as mesh:
        model = _load_model(folder, torch.device("cpu"), "fsdp" if mesh else "none", mesh, {}, trainable=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        collective = Collective.from_torch() if port is not None else ALONE
        optim = OptimConfig(minibatch_size=10_000, micro_batch_size=4, old_logprobs="rollout")
        if load_dir:
            load_train_state(model, optimizer, load_dir)

        def step() -> None:
            rl_step(model, optimizer, take(rows, splits[rank]), optim, lr=1e-3, norm_length=8, pad_id=0,
                    device="cpu", rng=np.random.default_rng(0), collective=collective)

        for _ in range(steps_before):
            step()
        if save_dir:
            save_train_state(model, optimizer, save_dir)
        step()
        params = full_parameters(model)
        if rank == 0:
            torch.save(params, out)


def packed_weights_on_ranks(rank: int, world: int, port: int, folder: str, dtype: str, bucket_bytes: int,
                            out: str) -> None:
    """One rank of a 2-rank FSDP2 model of `folder` packing its weights for the replicas (`pack_model_weights`,
    each parameter gathered on its own); rank 0 saves what a replica would read, and the bucket sizes, to `out`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from actors.trainer import _load_model, pack_model_weights
    from actors.weights import bucket_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _load_model(folder, torch.device("cpu"), "fsdp", mesh, {}, trainable=True)
        weights = pack_model_weights(model, "fsdp", dtype, bucket_bytes, rank, put=np.copy)
        if rank == 0:
            tensors = {name: t.clone() for b in weights.buckets for name, t in bucket_tensors(b.ref, b.entries, dtype)}
            torch.save({"tensors": tensors, "bucket_bytes": [b.nbytes for b in weights.buckets],
                        "entries": [len(b.entries) for b in weights.buckets]}, out)
        else:
            assert weights is None
    finally:
        dist.destroy_process_group()


LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"], "dropout": 0.0}


def lora_steps_on_ranks(rank: int, world: int, port: int | None, folder: str, rows: dict[str, list],
                        splits: list[list[int]], save_dir: str | None, load_dir: str | None, out: str) -> None:
    """One rank (or, with `port` None, a lone process) of a LoRA run as the Train job builds it (`_load_model` with
    `lora`, AdamW over the trainable parameters): the sharded state loaded from `load_dir`, or one RL step and the
    state saved to `save_dir`; then the adapter packed for the replicas and one more step. Rank 0 saves the packed
    adapter, the full parameters after the last step and the names of the trainable ones to `out`."""
    from actors.config import OptimConfig
    from actors.learner import ALONE, Collective, rl_step
    from actors.trainer import _load_model, load_train_state, pack_model_weights, save_train_state
    from actors.weights import bucket_tensors

    with rank_mesh(rank, world, port) as mesh:
        strategy = "fsdp" if mesh else "none"
        model = _load_model(folder, torch.device("cpu"), strategy, mesh, {"lora": LORA}, trainable=True)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        collective = Collective.from_torch() if port is not None else ALONE
        optim = OptimConfig(minibatch_size=10_000, micro_batch_size=4, old_logprobs="rollout")

        def step() -> None:
            rl_step(model, optimizer, take(rows, splits[rank]), optim, lr=1e-2, norm_length=8, pad_id=0,
                    device="cpu", rng=np.random.default_rng(0), collective=collective)

        if load_dir:
            load_train_state(model, optimizer, load_dir)
        else:
            step()
            if save_dir:
                save_train_state(model, optimizer, save_dir)
        weights = pack_model_weights(model, strategy, "float32", 1 << 20, rank, put=np.copy, adapter_only=True)
        step()
        params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for name, p in model.named_parameters()}
        if rank == 0:
            adapter = {name: t.clone() for b in weights.buckets for name, t in bucket_tensors(b.ref, b.entries,
                                                                                                "float32")}
            torch.save({"adapter": adapter, "kind": weights.kind, "params": params,
                        "trainable": [n for n, p in model.named_parameters() if p.requires_grad]}, out)


def weight_group_member(index: int, spec: dict[str, Any], fsdp_port: int, folder: str, dtype: str, bucket_bytes: int,
                        out: str, fail_after_first_bucket: bool = False) -> None:
    """One process of a collective weight sync: indices 0 and 1 are the ranks of a 2-rank FSDP2 model of `folder`
    (rank 0 sends it over the weight group `spec` as the Train job does, `send_model_weights`); every later index
    is a replica's engine process, receiving as weight-group rank index - 1 (`receive_into`). Each process saves
    what it saw to `out` formatted with its index. With `fail_after_first_bucket` the sender stops after one bucket
    (as a Train job that died mid-transfer)."""
    import torch.distributed as dist

    from actors.trainer import _load_model, send_model_weights
    from actors.weights import TransferError, join_group, receive_into, send_weights

    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    if index < 2:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=index, world_size=2)
        try:
            from torch.distributed.device_mesh import init_device_mesh

            model = _load_model(folder, torch.device("cpu"), "fsdp", init_device_mesh("cpu", (2,)), {},
                                trainable=True)
            if fail_after_first_bucket:
                if index == 0:
                    state = model.state_dict()
                    items = [(n, v.full_tensor()) for n, v in state.items()]

                    def dies():
                        yield from items[:1]
                        raise RuntimeError("the sender died")

                    try:
                        send_weights(join_group(spec, 0), dies(), [(n, tuple(v.shape)) for n, v in items], dtype,
                                     bucket_bytes, "full", 7)
                    except RuntimeError as e:
                        result["error"] = str(e)
                else:
                    for v in model.state_dict().values():
                        v.full_tensor()
            else:
                result = send_model_weights(model, "fsdp", dtype, bucket_bytes, index, spec, 7)
        finally:
            dist.destroy_process_group()
    else:
        got: dict[str, torch.Tensor] = {}

        def load(header, tensors, began):
            result["header"] = {k: header[k] for k in ("dtype", "kind", "version")}
            began()  # as an engine that loads each bucket as it arrives
            for name, t in tensors:
                got[name] = t.clone()

        try:
            result["bytes"] = receive_into(spec, index - 1, 7, dtype, load)
        except TransferError as e:
            result.update(error=str(e), loading_began=e.loading_began)
        result["tensors"] = got
    torch.save(result, out.format(index))
