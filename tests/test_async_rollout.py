"""Async rollout's pure parts: which rows may enter the loss (`fresh_rows`, the check the Train job runs on every
row), and the configs that may run async. The run itself (serve run, kills, /stop) is in test_train_e2e."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from actors.config import TrainConfig
from actors.learner import fresh_rows
from actors.rollouts import overlap_share
from tests.conftest import REPO


def _rows(versions: list[int]) -> dict[str, list]:
    return {"weight_version": versions, "prompt_ids": [[i] for i in range(len(versions))],
            "advantage": [float(i) for i in range(len(versions))]}


def test_fresh_rows_keeps_versions_within_the_bound_and_counts_every_row():
    rows, hist = fresh_rows(_rows([7, 6, 5, 7, 4, 8, 6]), version=7, max_staleness=2)
    # staleness 0, 1, 2, 0, 3 (too old), -1 (a version the trainer never had), 1
    assert rows["weight_version"] == [7, 6, 5, 7, 6]
    assert rows["prompt_ids"] == [[0], [1], [2], [3], [6]]  # every column filtered alike, order kept
    assert hist.tolist() == [2, 2, 1, 2]  # rows at staleness 0, 1, 2; left out
    assert hist.sum() == 7


def test_fresh_rows_in_sync_mode_keeps_only_the_current_version():
    rows, hist = fresh_rows(_rows([3, 3, 2]), version=3, max_staleness=0)
    assert rows["weight_version"] == [3, 3] and hist.tolist() == [2, 1]
    same, hist = fresh_rows(_rows([3, 3]), version=3, max_staleness=0)
    assert same["weight_version"] == [3, 3] and hist.tolist() == [2, 0]
    empty, hist = fresh_rows({}, version=3, max_staleness=1)
    assert empty == {} and hist.tolist() == [0, 0, 0]


def _tiny_args(**rollout) -> dict:
    spec = yaml.safe_load((REPO / "serve_configs" / "test_tiny.yaml").read_text())
    args = spec["applications"][0]["args"]
    args["rollout"].update(rollout)
    return args


def test_async_needs_the_decoupled_correction_and_names_the_fields():
    with pytest.raises(ValidationError, match="optim.old_logprobs 'recompute'.*optim.rollout_correction"):
        TrainConfig.model_validate(_tiny_args(mode="async"))
    args = _tiny_args(mode="async", max_staleness=2)
    args["optim"].update(old_logprobs="recompute", rollout_correction="tis")
    cfg = TrainConfig.model_validate(args)
    assert cfg.rollout.lookahead == 2
    args["rollout"].pop("max_staleness")
    assert TrainConfig.model_validate(args).rollout.lookahead == 1  # async's default bound


@pytest.mark.parametrize("rollout, field", [({"mode": "sync", "max_staleness": 1}, "max_staleness"),
                                            ({"mode": "overlap"}, "rollout.mode"),
                                            ({"mode": "async", "max_staleness": 0}, "rollout.max_staleness")])
def test_bad_async_settings_fail_with_the_field(rollout, field):
    args = _tiny_args(**rollout)
    args["optim"].update(old_logprobs="recompute", rollout_correction="tis")
    with pytest.raises(ValidationError) as e:
        TrainConfig.model_validate(args)
    assert field.split(".")[-1] in str(e.value)


def test_sync_is_the_default_and_runs_no_rollout_ahead():
    cfg = TrainConfig.model_validate(_tiny_args())
    assert cfg.rollout.mode == "sync" and cfg.rollout.lookahead == 0


def test_the_async_gpu_recipe_validates():
    spec = yaml.safe_load((REPO / "serve_configs" / "gpu" / "alfworld.yaml").read_text())
    cfg = TrainConfig.model_validate(spec["applications"][0]["args"])
    assert cfg.rollout.mode == "async" and cfg.rollout.lookahead == 1
    assert np.isclose(cfg.optim.rollout_is_cap, 2.0)


def test_overlap_share_is_the_union_of_the_rollouts_within_the_update():
    assert overlap_share([], 10.0, 20.0) == 0.0
    assert overlap_share([[0.0, 9.0]], 10.0, 20.0) == 0.0  # ended before the update
    assert overlap_share([[5.0, 15.0]], 10.0, 20.0) == pytest.approx(0.5)
    assert overlap_share([[12.0, None]], 10.0, 20.0) == pytest.approx(0.8)  # still running
    # two overlapping rollouts count once: [11, 17] of [10, 20]
    assert overlap_share([[11.0, 16.0], [13.0, 17.0]], 10.0, 20.0) == pytest.approx(0.6)


def test_concurrent_rollouts_on_one_actor_never_share_an_env():
    """Async mode runs two rollouts (or a rollout and a validation) on one env-group actor at once: each must step
    its own env instances, the pool reusing them only once handed back."""
    from actors.env_group import EnvPool

    built = []
    pool = EnvPool(lambda kwargs: built.append(object()) or built[-1])
    with pool.take(3, {"a": 1}) as first, pool.take(2, {"a": 1}) as second:
        assert len({id(e) for e in first + second}) == 5 and len(built) == 5
    with pool.take(4, {"a": 1}) as again:
        assert len(built) == 5 and {id(e) for e in again} <= {id(e) for e in built}  # reused, none new
    with pool.take(1, {"a": 2}) as other_kwargs:
        assert len(built) == 6 and other_kwargs[0] is built[-1]  # kwargs of their own
