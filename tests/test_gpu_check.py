"""The one-shot GPU check (benchmarks/gpu_check.py) where there is no GPU: its CPU smoke run at the tiny size
produces every figure the GPU run reports and records the CUDA-only parts as skipped with a reason, and a request
that needs CUDA ends with a message that says so, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run_check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # One thread: the check's figures do not matter here, and the machine's other work does.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cpu_smoke_run_reports_every_part(tmp_path):
    out = tmp_path / "results" / "gpu_check.json"  # the folder does not exist yet: the check makes it
    proc = run_check("--device", "cpu", "--sizes", "tiny", "--steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["complete"] and report["errors"] == []
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["device"] == "cpu"
    tiny = report["sizes"]["tiny"]

    step = tiny["fsdp_step"]
    assert len(step["step_s_all"]) == 2 and step["step_s"] > 0 and step["tokens_per_s"] > 0
    assert step["tokens_per_step"] == report["settings"]["batch"] * report["settings"]["seq_len"]
    assert step["peak_rss_gib_process"] > 0 and step["reply_tokens"] > 0

    move = tiny["transfer"]
    assert move["equal"] and move["packed_equal"] and move["local_copy_equal"]
    assert move["cpu_shared_memory"]["equal"] and move["cpu_shared_memory"]["seconds"] > 0
    assert move["bytes"] > 0 and move["buckets"] >= 1 and move["pack_s"] > 0

    group = tiny["weight_group_send"]  # the collective path's sender (gloo here, nccl on a GPU)
    assert group["backend"] == "gloo" and group["bytes"] >= move["bytes"] and group["send_s"] > 0

    gen = tiny["generation"]
    (batch,) = report["settings"]["gen_batches"]
    assert gen[f"batch_{batch}"]["tokens_per_s"] > 0
    assert gen[f"batch_{batch}"]["generated_tokens"] == batch * report["settings"]["new_tokens"]

    skipped = {s["part"]: s["reason"] for s in report["skipped"]}
    assert {"cuda_ipc", "nccl", "bf16_mixed_precision"} <= set(skipped)
    assert all("CUDA" in skipped[p] for p in ("cuda_ipc", "nccl", "bf16_mixed_precision"))
    try:
        import peft  # noqa: F401
    except ImportError:
        assert "peft" in skipped["lora_step"]
    else:
        lora = tiny["lora_step"]
        assert 0 < lora["trainable_params"] < lora["total_params"] and lora["adapter_bytes"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the requests below would run")
@pytest.mark.parametrize("args", [("--device", "cuda"), ("--device", "cpu", "--sizes", "0.5b")])
def test_requests_that_need_cuda_fail_with_a_message(tmp_path, args):
    out = tmp_path / "gpu_check.json"
    proc = run_check(*args, "--out", str(out), timeout=60)
    assert proc.returncode == 2
    assert "needs CUDA" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
