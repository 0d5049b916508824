"""`raygent sft` and the demonstrations it shares with the training app's warm start. No Ray cluster."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import yaml

import envs
import memory
from actors.demonstrations import demo_players, demo_seeds, make_demonstrations
from actors.prompting import encode_prompt
from app.cli import main

ENV_KWARGS = {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 15, "show_positions": True,
              "task_description": "Sokoban: push box X onto target O.",
              "prompt_template": "{task}\n{observation}\nActions: {actions}"}


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from app.default_model import resolve_model

    return resolve_model("default:tiny")


def _actor(model_path: str, memory_name: str, memory_kwargs: dict):
    """The env-group actor's class as plain Python (its methods need no cluster)."""
    from actors.env_group import EnvGroupActor

    cls = EnvGroupActor.__ray_metadata__.modified_class
    return cls("sokoban", ENV_KWARGS, memory_name, memory_kwargs, model_path, None, 512)


def test_demonstrations_are_what_the_env_group_actor_encodes(tiny_model):
    mem_name, mem_kwargs = "simple", {"k": 2}  # with memory: the prompt depends on the path taken
    actor = _actor(tiny_model, mem_name, mem_kwargs)
    tok = actor.tokenizer
    seeds, expert_prob, rng_seed = demo_seeds(0, 6).tolist(), 0.5, 3

    # The documented recipe, spelled out: states of a player that follows the expert with probability
    # expert_prob, else a random admissible action; prompts encoded by the actor; labels = expert action + EOS.
    rng = np.random.default_rng(rng_seed)
    want_prompts, want_labels, took_random = [], [], 0
    for seed in seeds:
        env, mem = envs.make("sokoban", **ENV_KWARGS), memory.make(mem_name, **mem_kwargs)
        observation, info = env.reset(seed=seed)
        for _ in range(env.max_steps):
            expert = env.expert_action()
            if expert is None:
                break
            want_prompts.append(encode_prompt(tok, env, observation, mem.render()))
            want_labels.append(tok.encode(f"<action>{expert}</action>", add_special_tokens=False)
                               + [tok.eos_token_id])
            actions = info["admissible_actions"]
            action = expert if rng.random() < expert_prob else actions[rng.integers(len(actions))]
            took_random += action != expert
            next_observation, reward, terminated, truncated, info = env.step(f"<action>{action}</action>")
            mem.store(observation, info.get("action"), reward, info)
            observation = next_observation
            if terminated or truncated:
                break

    demos = make_demonstrations(tok, "sokoban", ENV_KWARGS, mem_name, mem_kwargs, seeds, expert_prob, rng_seed)
    prompts, labels = demos["prompt_ids"], demos["response_ids"]
    assert set(demos) == {"prompt_ids", "response_ids"}  # step rows: every reply token is a target
    assert prompts == want_prompts and labels == want_labels
    assert took_random > 0 and len(prompts) > len(seeds)  # off-expert states are in there
    # Deterministic, and the actor method (the training app's warm start) returns exactly these rows.
    assert make_demonstrations(tok, "sokoban", ENV_KWARGS, mem_name, mem_kwargs, seeds, expert_prob,
                               rng_seed) == demos
    table, meta = asyncio.run(actor.demonstrations(seeds, expert_prob, rng_seed))
    assert table["prompt_ids"].to_pylist() == prompts and table["response_ids"].to_pylist() == labels
    assert meta == {"rows": len(prompts), "episodes": len(seeds)}
    # A prompt is the chat template around the env's prompt, ending in the generation prompt.
    text = tok.decode(prompts[0])
    assert "Sokoban: push box X onto target O." in text and text.endswith("<|assistant|>\n")
    assert tok.decode(labels[0], skip_special_tokens=True).startswith("<action>")


def test_demo_seeds_are_training_seeds_rl_never_reaches():
    seeds = demo_seeds(0, 50)
    players = demo_players(0, 50, 3)  # the split the controller and `raygent sft` both use
    assert [s for part, _ in players for s in part] == seeds.tolist()
    assert [rng_seed for _, rng_seed in players] == [0, 1, 2]
    assert (seeds % 2 == 0).all()  # training split
    assert not set(seeds) & set(envs.group_seeds(0, 0, 128, "val"))


def _write_config(path, **warm_start) -> str:
    args = {"seed": 0, "policy": {"model": "default:tiny", "max_model_len": 512},
            "env": {"name": "sokoban", "kwargs": ENV_KWARGS}, "memory": {"name": "none"},
            "rollout": {"max_tokens": 12}, "validation": {"n_envs": 8},
            "warm_start": {"enabled": True, "demo_seeds": 40, "expert_prob": 0.5, "steps": 30, "batch_size": 16,
                           "lr": 1e-3, "eval_every": 10, "target_success": 1.0, **warm_start}}
    serve_config = {"applications": [{"name": "train", "import_path": "app.train:build_train_app", "args": args}]}
    path.write_text(yaml.safe_dump(serve_config))
    return str(path)


def test_sft_writes_a_loadable_model_and_lowers_the_loss(tmp_path, tiny_model, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.config import load_train_config
    from app.default_model import resolve_model
    from app.engines import HFEngine, SamplingConfig

    out = tmp_path / "sft-sokoban"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is as fast for this model, and never oversubscribed
    try:
        rc = main(["sft", "--config", _write_config(tmp_path / "train.yaml"), "--out", str(out), "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["10/30", "20/30", "30/30"]
    assert all("held-out success" in line and "s/step" in line for line in lines)

    card = json.loads((out / "raygent_agent.json").read_text())
    summary = card["source"]["sft"]
    assert summary["steps"] == 30 and len(summary["history"]) == 3
    # the folder says what agent it is: the env, memory, prompt and sampling of the config it was trained with
    assert card["env"] == {"name": "sokoban", "kwargs": ENV_KWARGS} and card["memory"]["name"] == "none"
    assert card["prompt"]["prompt_template"] == ENV_KWARGS["prompt_template"] and card["heldout_split"] == "val"
    assert card["sampling"]["max_tokens"] == 12
    assert summary["last_loss"] < 0.7 * summary["first_loss"], summary
    assert summary["history"][-1]["loss"] < summary["history"][0]["loss"]
    assert not list(tmp_path.glob(".sft-sokoban.*"))  # no temp folder left behind

    # An HF folder: weights, config, tokenizer with the chat template; it differs from the starting weights.
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.eos_token_id == AutoTokenizer.from_pretrained(tiny_model).eos_token_id
    trained = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not torch.equal(trained.model.embed_tokens.weight, start.model.embed_tokens.weight)
    # ... usable as policy.model of a training run: the config accepts it, resolve_model finds it, the engine loads it.
    cfg = load_train_config({"policy": {"model": str(out)}, "warm_start": {"enabled": False}})
    assert resolve_model(cfg.policy.model) == str(out.resolve())
    engine = HFEngine(str(out), device="cpu")
    reply = engine.generate([tok.encode("hi", add_special_tokens=False)], [SamplingConfig(temperature=0,
                                                                                          max_tokens=4)])[0]
    assert reply.token_ids


@pytest.mark.parametrize("warm_start, field", [({"steps": 0}, "args.warm_start.steps"),
                                               ({"stepz": 5}, "args.warm_start.stepz")])
def test_bad_config_is_exit_2_naming_the_field(tmp_path, capsys, warm_start, field):
    rc = main(["sft", "--config", _write_config(tmp_path / "bad.yaml", **warm_start), "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_bad_flags_are_exit_2(tmp_path, capsys):
    assert main(["sft", "sokoban", "--lr", "-1"]) == 2
    assert "args.warm_start.lr" in capsys.readouterr().err
    assert main(["sft"]) == 2
    assert "--config" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    assert main(["sft", "sokoban", "--model", "default:tiny", "--out", str(tmp_path / "notes")]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_device_cuda_without_cuda_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["sft", "sokoban", "--model", "default:tiny", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
