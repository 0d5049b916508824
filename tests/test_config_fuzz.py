"""200 mutated copies of the embedded default's training config through the config loader, in one process: each
either validates or is refused with a message that names the field (args.<path>), never another exception."""

from __future__ import annotations

import copy
import random

import pytest
import yaml

from actors.config import load_train_config
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "serve_configs" / "train.yaml").read_text())["applications"][0]["args"]
ODD_VALUES = [-1, 0, 1e12, -0.5, "", "x" * 300, None, [], {}, [1, 2, 3], {"nested": {"deep": 1}}, True, "auto",
              3.7, "1e-3", float("nan")]


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))


def _mutate(rng: random.Random) -> tuple[dict, str]:
    args = copy.deepcopy(BASE)
    paths = list(_paths(args))
    path = rng.choice(paths)
    parent = args
    for key in path[:-1]:
        parent = parent[key]
    kind = rng.choice(["value", "delete", "unknown", "section"])
    if kind == "value":
        parent[path[-1]] = rng.choice(ODD_VALUES)
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "unknown":
        path = path[:-1] + (path[-1] + "_typo",)
        parent[path[-1]] = rng.choice(ODD_VALUES)
    else:
        path = (rng.choice(list(args)),)
        args[path[0]] = rng.choice(ODD_VALUES)
    return args, ".".join(map(str, path))


@pytest.mark.parametrize("seed", range(200))
def test_a_mutated_config_validates_or_names_the_field(seed):
    args, changed = _mutate(random.Random(seed))
    try:
        load_train_config(args)
    except ValueError as e:
        message = str(e)
        assert message.startswith("invalid training config:"), (changed, message)
        # the message names the changed field, or the section whose check it broke (a cross-field rule)
        section = changed.split(".")[0]
        assert f"args.{section}" in message or "args: " in message, (changed, message)
