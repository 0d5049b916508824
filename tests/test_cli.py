"""The `raygent` console command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RAYGENT = str(Path(sys.executable).with_name("raygent"))


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([RAYGENT, *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_envs_lists_every_builtin():
    import envs

    out = run("envs")
    assert out.returncode == 0, out.stderr
    for name in envs.list_envs():
        assert name in out.stdout


def test_play_sokoban_shows_the_agent_prompt_and_plays_to_the_end():
    import envs
    import memory
    from actors.prompting import agent_messages

    env = envs.make("sokoban")
    observation, _ = env.reset(seed=3)
    expected_first_prompt = agent_messages(env, observation, memory.make("simple").render())[0]["content"]
    moves = envs.sokoban.solve(observation)
    out = run("play", "sokoban", "--seed", "3", stdin="bogus\n" + "\n".join(moves) + "\n")
    assert out.returncode == 0, out.stderr
    assert expected_first_prompt in out.stdout
    assert "INVALID" in out.stdout  # "bogus" is not an action
    assert "won" in out.stdout and "not won" not in out.stdout


def test_play_unknown_env_is_a_clear_error():
    out = run("play", "no-such-env")
    assert out.returncode == 2
    assert "unknown" in out.stderr and "sokoban" in out.stderr


def test_train_refuses_a_bad_config_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n- name: train\n  import_path: app.train:build_train_app\n"
                   "  args: {optim: {lr: -1}}\n")
    out = run("train", str(bad))
    assert out.returncode == 2 and "args.optim.lr" in out.stdout


def test_eval_writes_a_report_per_split_with_pass_at_k(tmp_path):
    """`raygent eval` on a model folder without a card (the built-in model) and ALFWorld: every held-out split,
    per-task numbers, pass@k over the samples, each episode's seeds; the exact evaluation training validates with."""
    import json

    report_path = tmp_path / "report.json"
    out = run("eval", "--checkpoint", "default:tiny", "--env", "alfworld", "--seeds", "3", "--samples", "2",
              "--max-steps", "2", "--engine", "hf", "--temperature", "1.0", "--out", str(report_path))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert set(report["splits"]) == {"valid_seen", "valid_unseen"}
    for part in report["splits"].values():
        summary = part["summary"]
        assert summary["episodes"] == 6 and {"pass@1", "pass@2", "per_task", "success_rate"} <= set(summary)
        assert all(e["task_type"] and e["sampling_seed"] is not None for e in part["episodes"])
        assert len({e["sampling_seed"] for e in part["episodes"]}) == 6
    assert "valid_unseen" in out.stdout and "pass@2" in out.stdout
    missing = run("eval", "--checkpoint", "default:tiny", "--seeds", "1")
    assert missing.returncode == 2 and "--env" in missing.stderr


def test_train_set_changes_the_config_and_a_bad_value_names_its_field(tmp_path):
    """`raygent train CONFIG --set KEY=VALUE`: an override is validated like the file (a bad value names the
    field, a deployment the app lacks names the ones it has: exit 2, nothing started); the config that runs is the
    file with the overrides, to the args or to a deployment (`deployments.NAME.FIELD`), written to the run folder as
    a valid Serve config."""
    from ray.serve.schema import ServeDeploySchema

    from app.launch import _write_config, apply_overrides, parse_overrides
    from app.sft import read_config_file

    config = Path(__file__).resolve().parents[1] / "serve_configs" / "test_tiny.yaml"
    out = run("train", str(config), "--set", "optim.lr=-1")
    assert out.returncode == 2 and "args.optim.lr" in out.stdout, out.stdout
    out = run("train", str(config), "--set", "iterations")
    assert out.returncode == 2 and "KEY=VALUE" in out.stdout, out.stdout
    out = run("train", str(config), "--set", "deployments.Polcy.num_replicas=1")
    assert out.returncode == 2 and "no deployment 'Polcy'" in out.stdout and "Policy" in out.stdout, out.stdout

    import yaml

    overrides = parse_overrides(["iterations=3", "placement.env_actors={cpu_node: 1}", "run_name=x",
                                 "deployments.Policy.ray_actor_options.num_gpus=0",
                                 "deployments.Policy.num_replicas=3"])
    assert overrides["iterations"] == 3 and overrides["placement.env_actors"] == {"cpu_node": 1}
    spec = apply_overrides(yaml.safe_load(config.read_text()), overrides)
    written = _write_config(config, spec, overrides, tmp_path)
    ServeDeploySchema.model_validate(yaml.safe_load(written.read_text()))
    args, original = read_config_file(written), read_config_file(config)
    assert args["iterations"] == 3 and args["placement"]["env_actors"] == {"cpu_node": 1} and args["run_name"] == "x"
    assert {k: v for k, v in args.items() if k not in ("iterations", "placement", "run_name")} == \
        {k: v for k, v in original.items() if k not in ("iterations", "placement", "run_name")}
    (policy,) = [d for d in yaml.safe_load(written.read_text())["applications"][0]["deployments"]
                 if d["name"] == "Policy"]
    assert policy["num_replicas"] == 3 and policy["ray_actor_options"]["num_gpus"] == 0
    assert policy["ray_actor_options"]["num_cpus"] == yaml.safe_load(config.read_text())["applications"][0][
        "deployments"][0]["ray_actor_options"]["num_cpus"], "a deployment's other fields were lost"
