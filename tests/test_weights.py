"""How weights travel (actors/weights.py): packed in the engine's dtype into buckets of bounded size in the object
store, read back as views one bucket at a time. What the Train job packs, a replica and a checkpoint read back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from actors.weights import Weights, pack_weights
from tests.update_helpers import build_model, free_port, packed_weights_on_ranks, weight_group_member

KIB = 1024


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(64, 16, generator=g), "norm": torch.randn(16, generator=g),
            "scale": torch.tensor(3.5), "big": torch.randn(40, 64, generator=g),  # 10 KiB: over a 4 KiB bucket
            "proj": torch.randn(16, 16, generator=g), "bias": torch.randn(7, generator=g)}


def test_float32_round_trip_in_bounded_buckets(ray_cluster):
    sd = state_dict()
    weights = pack_weights(sd.items(), "float32", 4 * KIB)
    assert isinstance(weights, Weights) and weights.names == list(sd)
    for bucket in weights.buckets:  # bounded, except a tensor larger than a bucket, which travels alone
        assert bucket.nbytes <= 4 * KIB or len(bucket.entries) == 1
        assert ray_cluster.get(bucket.ref).nbytes == bucket.nbytes
    assert len(weights.buckets) >= 3
    got = dict(weights.tensors())
    assert list(got) == list(sd)
    for name, t in sd.items():
        assert got[name].dtype == torch.float32 and got[name].shape == t.shape
        assert torch.equal(got[name], t), name
        assert got[name].data_ptr() % 64 == 0  # aligned views
    # numpy arrays (a model folder's) pack the same way
    again = pack_weights({k: v.numpy() for k, v in sd.items()}.items(), "float32", 4 * KIB).state_dict()
    assert all(torch.equal(again[k], sd[k]) for k in sd)


def test_bfloat16_travels_in_half_the_bytes(ray_cluster):
    sd = state_dict()
    full = pack_weights(sd.items(), "float32", 1 << 20)
    half = pack_weights(sd.items(), "bfloat16", 1 << 20)
    assert half.nbytes < 0.6 * full.nbytes
    got = half.state_dict()
    for name, t in sd.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], t.to(torch.bfloat16)), name


def test_a_bad_dtype_names_the_allowed_ones():
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        pack_weights([], "int8", 1024)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_written_from_weights_reads_back_equal(ray_cluster, tmp_path, dtype):
    from actors.checkpoint import load_model_weights, save_model

    folder = build_model(tmp_path / "policy")
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text((folder / "config.json").read_text())
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # as the trainer sends a tied head
    weights = pack_weights(sd.items(), dtype, 8 * KIB)
    save_model(weights.state_dict(), template, tmp_path / "out")
    back = load_model_weights(tmp_path / "out")
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert back[name].dtype == getattr(torch, dtype)
        assert torch.equal(back[name], t.to(getattr(torch, dtype))), name


@pytest.mark.slow
def test_two_fsdp_ranks_pack_every_parameter_gathered(tmp_path):
    """Each FSDP2 parameter gathered on its own and packed on rank 0: the model's full weights, under the names the
    engines load, in buckets no larger than asked (beyond a lone tensor)."""
    from safetensors.torch import load_file

    folder = build_model(tmp_path / "policy")
    bucket = 8 * KIB
    mp.start_processes(packed_weights_on_ranks, args=(2, free_port(), str(folder), "float32", bucket,
                                                      str(tmp_path / "w.pt")), nprocs=2, start_method="spawn")
    packed = torch.load(tmp_path / "w.pt")
    expected = load_file(str(folder / "model.safetensors"))
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert set(packed["tensors"]) == set(expected)
    for name, t in expected.items():
        assert torch.equal(packed["tensors"][name], t), name
    assert len(packed["bucket_bytes"]) > 1
    assert all(n <= bucket or k == 1 for n, k in zip(packed["bucket_bytes"], packed["entries"], strict=True))
    assert np.sum(packed["bucket_bytes"]) >= sum(t.numel() * 4 for t in expected.values())


def test_the_collective_layout_is_the_packers(ray_cluster):
    """The bucket table a collective sender announces before it gathers anything is the one the object-store packer
    fills: the same entries and offsets, bucket by bucket."""
    from actors.weights import bucket_layout

    sd = state_dict()
    for dtype in ("float32", "bfloat16"):
        weights = pack_weights(sd.items(), dtype, 4 * KIB)
        layout = bucket_layout([(k, tuple(v.shape)) for k, v in sd.items()], dtype, 4 * KIB)
        assert [(list(b.entries), b.nbytes) for b in weights.buckets] == layout


def _group(timeout_s: float, receivers: int):
    import uuid

    import torch.distributed as dist

    from actors.weights import GroupSpec

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = GroupSpec(f"test-{uuid.uuid4().hex[:6]}", "127.0.0.1", store.port, "gloo", timeout_s,
                     {f"replica-{i}": i + 1 for i in range(receivers)})
    return store, spec


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_fsdp_ranks_broadcast_the_weights_to_every_replica_over_gloo(tmp_path, dtype):
    """The collective path end to end in processes: 2 FSDP2 ranks gather one parameter at a time and rank 0
    broadcasts the buckets over a gloo weight group; two receivers get every weight, in the dtype sent, equal to
    the model's (the tied head included), and the header they read names the version."""
    from safetensors.torch import load_file

    folder = build_model(tmp_path / "policy")
    store, spec = _group(30.0, receivers=2)
    out = str(tmp_path / "member{}.pt")
    mp.start_processes(weight_group_member, args=(spec.to_dict(), free_port(), str(folder), dtype, 8 * KIB, out),
                       nprocs=4, start_method="spawn")
    sender = torch.load(out.format(0))
    expected = load_file(str(folder / "model.safetensors"))
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    total = sum(t.numel() for t in expected.values()) * (4 if dtype == "float32" else 2)
    assert "send_error" not in sender and total <= sender["sent_bytes"] < total + 64 * 64
    for index in (2, 3):
        got = torch.load(out.format(index))
        assert got["header"] == {"dtype": dtype, "kind": "full", "version": 7}
        assert got["bytes"] == sender["sent_bytes"]
        assert set(got["tensors"]) == set(expected)
        for name, t in expected.items():
            assert got["tensors"][name].dtype == getattr(torch, dtype)
            assert torch.equal(got["tensors"][name], t.to(getattr(torch, dtype))), name


@pytest.mark.slow
def test_a_missing_member_or_a_sender_that_dies_fails_the_transfer_on_every_member_within_the_timeout(tmp_path):
    """A group that waits for a member that never comes: the sender reports the failure (it does not raise: the
    Train job goes on, its other rank still finishes the gathers), the receivers raise with nothing loaded, all
    within the group's timeout. A sender that dies after one bucket: the receivers fail with loading begun (their
    engine is half loaded and must not serve)."""
    import time

    folder = build_model(tmp_path / "policy")
    out = str(tmp_path / "missing{}.pt")
    store, spec = _group(3.0, receivers=3)  # rank 3 never joins
    started = time.monotonic()
    mp.start_processes(weight_group_member, args=(spec.to_dict(), free_port(), str(folder), "float32", 8 * KIB, out),
                       nprocs=4, start_method="spawn")
    assert time.monotonic() - started < 60
    assert "send_error" in torch.load(out.format(0))
    for index in (2, 3):
        got = torch.load(out.format(index))
        assert got["loading_began"] is False and not got["tensors"], got

    out = str(tmp_path / "dies{}.pt")
    store, spec = _group(10.0, receivers=2)  # the members meet; the receivers then wait 10 s for the next bucket
    mp.start_processes(weight_group_member, args=(spec.to_dict(), free_port(), str(folder), "float32", 1 * KIB, out,
                                                  True), nprocs=4, start_method="spawn")
    assert torch.load(out.format(0))["error"] == "the sender died"
    for index in (2, 3):
        got = torch.load(out.format(index))
        assert got["loading_began"] is True and got["tensors"], got  # the first bucket arrived, then nothing


def test_nccl_without_a_gpu_is_refused_with_what_to_change():
    from actors.weights import group_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no CUDA device.*trainer.use_gpu.*object_store"):
        group_device("nccl")
