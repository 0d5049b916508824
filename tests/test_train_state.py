"""The Train job's sharded state (`train_state/` of a checkpoint, torch.distributed.checkpoint), without Ray: what
two FSDP2 ranks write is one shard file each (no rank holds the whole optimizer), and reading it back, into two
ranks or into one unsharded process, continues the run exactly: the next step's weights are those of the run that
never stopped."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from actors.checkpoint import TRAIN_STATE, train_state_of
from tests.update_helpers import build_model, free_port, make_rows, steps_with_train_state

N_ROWS = 13
pytestmark = pytest.mark.slow  # three process groups of two ranks


def _two_ranks(folder, rows, steps_before, save_dir, load_dir, out) -> torch.Tensor:
    splits = [list(range(7)), list(range(7, N_ROWS))]
    mp.start_processes(steps_with_train_state,
                       args=(2, free_port(), str(folder), rows, splits, steps_before, save_dir, load_dir, str(out)),
                       nprocs=2, start_method="spawn")
    return torch.load(out)


def test_sharded_state_resumes_exactly_on_two_ranks_and_on_one(tmp_path):
    folder = build_model(tmp_path / "policy", seed=0)
    rows = make_rows(N_ROWS, seed=3)
    checkpoint = tmp_path / "iter_000002"
    state_dir = checkpoint / TRAIN_STATE

    # The run that never stops: two steps, its state saved, a third step.
    uninterrupted = _two_ranks(folder, rows, 2, str(state_dir), None, tmp_path / "a.pt")
    shards = sorted(p.name for p in state_dir.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"] and (state_dir / ".metadata").is_file()
    sizes = [(state_dir / name).stat().st_size for name in shards]
    assert max(sizes) < 0.7 * sum(sizes), f"one rank wrote most of the state: {sizes}"
    assert train_state_of(checkpoint) == {"train_state": str(state_dir), "optimizer_state": None}

    # Resumed on two ranks from the starting model: the sharded model and Adam state are what the third step used.
    resumed = _two_ranks(folder, rows, 0, None, str(state_dir), tmp_path / "b.pt")
    assert torch.equal(resumed, uninterrupted)

    # Resumed in one process (DCP reshards): the same step over all rows, equal up to fp32 summation order.
    steps_with_train_state(0, 1, None, str(folder), rows, [list(range(N_ROWS))], 0, None, str(state_dir),
                           str(tmp_path / "c.pt"))
    alone = torch.load(tmp_path / "c.pt")
    assert (alone - uninterrupted).abs().max() < 1e-6

    # Without its state the third step goes elsewhere: the comparisons above can fail.
    fresh = _two_ranks(folder, rows, 0, None, None, tmp_path / "d.pt")
    assert (fresh - uninterrupted).abs().max() > 1e-4

    # Fresh Adam moments (a checkpoint just after the warm start's reset) are saved as none: saving them does not
    # step the optimizer, and a resume from them takes a fresh optimizer's first step, bias correction included.
    fresh_dir = tmp_path / "iter_000000" / TRAIN_STATE
    assert torch.equal(_two_ranks(folder, rows, 0, str(fresh_dir), None, tmp_path / "e.pt"), fresh)
    assert torch.equal(_two_ranks(folder, rows, 0, None, str(fresh_dir), tmp_path / "f.pt"), fresh)
