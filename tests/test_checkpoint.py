"""Checkpoints and run state on disk, without Ray: rotation keeps what the run still needs, a re-checkpoint never
leaves its iteration without a checkpoint, a refused disk write loses nothing, a resume cuts the metrics back, and
a resumed config may change only what does not change the objective."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from actors.checkpoint import LAYOUT_VERSION, latest_checkpoint, list_checkpoints, load_state, save_checkpoint
from actors.config import LoggingConfig, check_resume_config
from actors.metrics import MetricsSink


@pytest.fixture()
def template(tmp_path: Path) -> Path:
    folder = tmp_path / "template"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return folder


def _save(run: Path, iteration: int, template: Path, keep: int, pinned=frozenset(), **kw) -> Path:
    weights = {"w": np.full((2, 2), float(iteration), dtype=np.float32)}
    return asyncio.run(save_checkpoint(run, iteration, weights, template, {"iteration": iteration}, keep,
                                       pinned=pinned, **kw))


def test_rotation_keeps_the_newest_and_the_pinned(tmp_path, template):
    run = tmp_path / "run"
    first = _save(run, 1, template, keep=1)
    for it in (2, 3, 4):
        _save(run, it, template, keep=1, pinned={first})
    assert [p.name for p in list_checkpoints(run)] == ["iter_000001", "iter_000004"]
    assert load_state(first)["layout_version"] == LAYOUT_VERSION and (first / "model" / "model.safetensors").exists()


def test_recheckpointing_an_iteration_swaps_in_the_new_one(tmp_path, template, monkeypatch):
    run = tmp_path / "run"
    _save(run, 3, template, keep=2)
    seen = []
    real = __import__("os").replace

    def watching_replace(src, dst):  # at every rename, a complete iter_000003 exists under some name
        seen.append(any((p / "state.json").exists() for p in (run / "checkpoints").iterdir()))
        return real(src, dst)

    monkeypatch.setattr("actors.checkpoint.os.replace", watching_replace)
    _save(run, 3, template, keep=2)
    assert all(seen) and [p.name for p in list_checkpoints(run)] == ["iter_000003"]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_refused_write_keeps_the_previous_checkpoint(tmp_path, template):
    run = tmp_path / "run"
    good = _save(run, 1, template, keep=3)

    async def full_disk(path: str) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        _save(run, 2, template, keep=3, save_train_state=full_disk)
    assert latest_checkpoint(run) == good and load_state(good)["iteration"] == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["iter_000001"]  # no half-written folder


FULL_DISK_WRITER = """
import asyncio, sys
from pathlib import Path
import numpy as np
from actors.checkpoint import latest_checkpoint, load_model_weights, load_state, save_checkpoint

run, template = Path(sys.argv[1]), Path(sys.argv[2])
def save(iteration, size):
    weights = {"w": np.full((size,), float(iteration), dtype=np.float32)}
    return asyncio.run(save_checkpoint(run, iteration, weights, template, {"iteration": iteration}, keep=3))
good = save(1, 1000)                  # 4 kB: fits
try:
    save(2, 100_000)                  # 400 kB of weights on a 256 kB disk
    print("NO ERROR")
except OSError as e:
    print("OSError", e)
assert latest_checkpoint(run) == good and load_state(good)["iteration"] == 1
assert float(load_model_weights(good / "model")["w"][0]) == 1.0
print(sorted(p.name for p in (run / "checkpoints").iterdir()))
"""


def test_a_full_disk_refuses_the_weights_and_keeps_the_previous_checkpoint(tmp_path, template):
    """A real full disk (a 256 kB tmpfs in a private mount namespace: CI runs as root, so chmod cannot refuse a
    write): the safetensors write fails as an OSError (the controller's refused-write path), the earlier checkpoint
    stays loadable and no half-written folder is left."""
    import subprocess
    import sys

    from tests.conftest import REPO

    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(FULL_DISK_WRITER)
    cmd = f"mount -t tmpfs -o size=256k tmpfs {run} && exec {sys.executable} {script} {run} {template}"
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "mount" in out.stderr and "permission" in out.stderr.lower():
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OSError" in out.stdout and "No space left" in out.stdout, out.stdout
    assert out.stdout.strip().splitlines()[-1] == "['iter_000001']", out.stdout


def test_resume_cuts_metrics_back_to_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sink = MetricsSink(run, "r", LoggingConfig(), {}, resume_iteration=None)
    for it in range(0, 6):
        sink.log({"iteration": it, "phase": "train" if it else "baseline"})
    resumed = MetricsSink(run, "r", LoggingConfig(), {}, resume_iteration=3)
    assert [r["iteration"] for r in resumed.records] == [0, 1, 2, 3]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    resumed.truncate(1)
    assert [r["iteration"] for r in resumed.records] == [0, 1]


def test_resume_refuses_a_changed_objective_and_names_it():
    assert check_resume_config({"iterations": 4}, {"iterations": 8, "optim": {"micro_batch_size": 8},
                                                   "trainer": {"num_workers": 1, "strategy": "none"}}) == [
        "iterations", "optim.micro_batch_size", "trainer.num_workers", "trainer.strategy"]
    with pytest.raises(ValueError) as err:
        check_resume_config({}, {"optim": {"lr": 1e-3}, "algorithm": {"estimator": "grpo"}})
    assert "args.optim.lr" in str(err.value) and "args.algorithm.estimator" in str(err.value)
    assert "checkpoint.resume: never" in str(err.value)


def test_checkpoint_weights_come_back_with_a_tied_head(tmp_path):
    """The file stores a tied head once (as HF does); the weights handed to replicas carry it again, or an engine
    reloading in place keeps the head it had (measured: a 0.006 log-prob gap after a Train restart)."""
    from safetensors.numpy import save_file

    from actors.checkpoint import load_model_weights

    embed = np.arange(6, dtype=np.float32).reshape(3, 2)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    weights = load_model_weights(tmp_path)
    np.testing.assert_array_equal(weights["lm_head.weight"], embed)
