"""Every built-in agent env trains from its CPU smoke config, as a user runs it: `serve run
serve_configs/<env>_cpu.yaml` as a subprocess on the session's Ray cluster, cut to 1 iteration, with transformers
answering and one Train worker (the env is the subject; vLLM and 2 FSDP2 ranks are the gateway run's and
test_train_e2e.py's), polled over HTTP until done. Checks the iteration's metrics (success rate, valid-action ratio,
a finite loss), the final validation and checkpoint, and the warm start where the config has one. These run last
(conftest): `serve run` shuts Serve down when it exits."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.conftest import REPO
from tests.serve_helpers import ServeRun, get_history, get_status, training_config, wait_for

pytestmark = pytest.mark.slow

# math_tool's own step-mode config is not run here (its env trains in conversation mode below and gives the tasks of
# the gateway run; step mode trains in every other run): the suite's time budget (docs/testing.md)
AGENT_ENVS = ("alfworld", "webshop", "search", "math_tool_conversation")


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
    # A warm start of 4 steps: its path, not its learning (the suite's time budget).
    warm = args["warm_start"]
    if warm["enabled"]:
        warm = {**warm, "steps": min(warm["steps"], 4), "eval_every": min(warm.get("eval_every", 4), 4)}
    # The env is the subject here: its replies come from transformers (`engine: hf`, a replica starts in seconds
    # instead of vLLM's ~30) and one Train worker updates. vLLM and FSDP2 over 2 ranks train in the gateway run
    # below and in test_train_e2e.py (docs/testing.md).
    config = training_config(source, tmp_path / "config.yaml", port, tmp_path / "runs", iterations=1,
                             warm_start=warm, validation={**args["validation"], "baseline_envs": 0},
                             policy={**args["policy"], "engine": "hf"}, trainer={**args["trainer"], "num_workers": 1})
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


def test_users_own_agents_train_through_the_gateway(ray_cluster, serve_url, tmp_path):
    """`serve run serve_configs/gateway_calculator_cpu.yaml` with the three example agents (examples/: the `openai`
    client, LangGraph, the Agents SDK; `examples.three_agents` gives each task to one of them by its seed) playing
    math_tool's tasks through each env-group actor's gateway for 2 iterations, every agent a group of each. Their
    calls become conversation rows that the Train job trains (the policy moves from its start: KL > 0), the held-out
    validation runs the same agents, and the checkpoint's card says conversation. Served by the agent endpoint, the
    checkpoint answers the same agent's code unchanged, its base URL pointing there."""
    import asyncio

    from ray import serve

    import envs
    from actors.checkpoint import read_agent_card
    from actors.gateway import AgentLLM
    from app.agent import build_agent_app
    from examples import calculator_agent

    source = REPO / "serve_configs" / "gateway_calculator_cpu.yaml"
    args = yaml.safe_load(source.read_text())["applications"][0]["args"]
    port = int(serve_url.rsplit(":", 1)[1])
    seed, n_groups = 108, 3  # seeds whose tasks go to each agent once in both iterations
    assert all(sorted(int(s) % 3 for s in envs.group_seeds(seed, it, n_groups, "train")) == [0, 1, 2]
               for it in range(2))
    rollout = {**args["rollout"], "n_groups": n_groups}
    # The tiny model never solves a problem: every reward is 0, so is every advantage; an entropy bonus moves the
    # policy all the same, through the loss over the recorded rows (their masks, the engine's log-probs).
    optim = {**args["optim"], "entropy_coef": 0.01}
    config = training_config(source, tmp_path / "config.yaml", port, tmp_path / "runs", iterations=2, seed=seed,
                             agent={**args["agent"], "entrypoint": "examples.three_agents:run"}, rollout=rollout,
                             optim=optim, validation={**args["validation"], "baseline_envs": 0})
    _delete_train_app()
    run = ServeRun(config, tmp_path / "serve_run.log", ray_cluster.get_runtime_context().gcs_address)
    try:
        status = wait_for(lambda: (s := get_status(serve_url))["run_name"] == args["run_name"] and s["done"] and s,
                          600, "the gateway run to finish", run)
        history = get_history(serve_url)
    finally:
        run.stop()
        _delete_train_app()
    assert status["phase"] == "done" and status["error"] is None, (status, run.log.read_text()[-3000:])
    train = [r for r in history if r.get("phase") == "train"]
    assert [r["iteration"] for r in train] == [1, 2], history
    for r in train:
        assert r["train/episodes"] == n_groups * args["rollout"]["group_size"], r
        assert r["faults/agent_errors"] == 0 and r["faults/agent_timeouts"] == 0, r
        # the openai-client agent reminds a model that neither calls nor answers, up to 4 calls: its calls merge into
        # one row (the engine's tokens and the template's deltas) whose log-probs the trainer reads back as the
        # engine's
        assert r["train/episode_length"] > 1 and r["data/rows"] == r["train/episodes"], r
        assert r["train/gateway_merged_share"] == 1.0 and _finite(r["train/loss"]), r
        assert r["train/rollout_trainer_logprob_gap"] < 1e-3, r
    assert train[-1]["train/kl"] > 0, [r["train/kl"] for r in train]  # the update moved the policy from its start
    assert "val/success_rate" in train[-1] and not any("val/random_policy_success" in r for r in history)
    card = read_agent_card(status["last_checkpoint"] + "/model")
    assert card.agent_loop == "conversation"

    # the trained agent, as its users run it afterwards: the same function against the agent endpoint
    served = {"policy": {"model": status["last_checkpoint"] + "/model", "engine": "hf"}, "served_model_name": "policy"}
    serve.run(build_agent_app(served), name="trained-agent", route_prefix="/trained")
    try:
        env = envs.make("math_tool")
        env.reset(seed=1)
        reward = asyncio.run(calculator_agent.run(env.task_row(), AgentLLM(f"{serve_url}/trained/v1", 120)))
    finally:
        serve.delete("trained-agent")
    assert reward in (0.0, 1.0)
