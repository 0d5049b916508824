"""Every built-in agent env trains from its CPU smoke config, as a user runs it: `serve run
serve_configs/<env>_cpu.yaml` as a subprocess on the session's Ray cluster, cut to 1 iteration, polled over HTTP
until done. Checks the iteration's metrics (success rate, valid-action ratio, a finite loss), the final validation
and checkpoint, and the warm start where the config has one. These run last (conftest): `serve run` shuts Serve down
when it exits."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.conftest import REPO
from tests.serve_helpers import ServeRun, get_history, get_status, training_config, wait_for

pytestmark = pytest.mark.slow

AGENT_ENVS = ("alfworld", "webshop", "search", "math_tool", "math_tool_conversation")


def _delete_train_app() -> None:
    """A `serve run` stopped with SIGTERM leaves its app deployed; the next run's /status must not come from it."""
    from ray import serve

    try:
        serve.delete("train")
    except Exception:
        pass


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.parametrize("env", AGENT_ENVS)
def test_cpu_smoke_config_trains(env, ray_cluster, serve_url, tmp_path):
    source = REPO / "serve_configs" / f"{env}_cpu.yaml"
    args = yaml.safe_load(source.read_text())["applications"][0]["args"]
    run_name = args["run_name"]
    port = int(serve_url.rsplit(":", 1)[1])
    # One iteration (its validation and checkpoint come with it, as the run's last); no validation of the untrained
    # policy (the same evaluation as the last, and the costliest: noise of max_tokens at every step).
    config = training_config(source, tmp_path / "config.yaml", port, tmp_path / "runs", iterations=1,
                             validation={**args["validation"], "baseline_envs": 0})
    _delete_train_app()
    run = ServeRun(config, tmp_path / "serve_run.log", ray_cluster.get_runtime_context().gcs_address)
    try:
        status = wait_for(lambda: (s := get_status(serve_url))["run_name"] == run_name and s["done"] and s, 600,
                          f"the {env} run to finish", run)
        history = get_history(serve_url)
    finally:
        run.stop()
        _delete_train_app()
    log = run.log.read_text()[-3000:]
    assert status["phase"] == "done" and status["error"] is None, (status, log)
    assert status["iteration"] == 1 and status["weight_version"] >= 1, status

    train = [r for r in history if r.get("phase") == "train"]
    assert [r["iteration"] for r in train] == [1], history
    for r in train:
        assert 0.0 <= r["train/success_rate"] <= 1.0, r
        assert 0.0 <= r["train/valid_action_ratio"] <= 1.0, r
        assert r["train/episodes"] == args["rollout"]["n_groups"] * args["rollout"]["group_size"], r
        assert r["data/rows"] > 0, r
        assert _finite(r.get("train/loss")), r
    assert "val/success_rate" in train[-1] and "val/valid_action_ratio" in train[-1], train[-1]
    assert "val/random_policy_success" in history[0], history[0]
    if args["warm_start"]["enabled"]:
        warm = [r for r in history if r.get("phase") == "warm_start"]
        assert warm and all(_finite(r.get("warm_start/sft_loss")) for r in warm), warm
    assert status["last_checkpoint"].endswith("iter_000001"), status
    if args["rollout"].get("agent_loop", "step") != "step":
        _check_conversation_run(train[-1], status, args)


def _check_conversation_run(record, status, args):
    """One row per conversation (not per step), only the model's tokens trained, and a checkpoint whose agent card
    plays it as a conversation."""
    from actors.checkpoint import read_agent_card

    assert record["data/rows"] <= record["train/episodes"] < record["train/episode_length"] * record["train/episodes"]
    assert record["perf/prompt_tokens_per_step"] > 0 and "train/token_budget_endings" in record, record
    card = read_agent_card(status["last_checkpoint"] + "/model")
    assert card.agent_loop == "conversation" and card.conversation_tokens == args["rollout"]["conversation_tokens"]
