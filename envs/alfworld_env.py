"""ALFWorld: text household tasks played on the real alfworld / TextWorld PDDL engine.

The agent walks between receptacles ("go to fridge 1"), opens them, takes and moves objects, heats, cools or
cleans them with the microwave, fridge or sink, and switches lamps on, to finish one of ALFWorld's six task types.
Every step runs on TextWorld's `PddlEnv` (fast-downward grounding of alfworld's PDDL domain, text from alfworld's
grammar), wrapped in alfworld's own `AlfredDemangler`, which names entities "apple 1", "countertop 2", ... exactly
as in the published benchmark. The expert is the engine's planner (`PddlState.replan`, the same call behind
textworld's `policy_commands` and alfworld's planner expert).

Task instances come from one of two places:
* the official game files, when `data_path` (default: the ALFWORLD_DATA environment variable) holds
  `json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/game.tw-pddl`; or
* `generate_game`, which writes a PDDL problem from what the alfworld wheel ships: a floor plan's receptacles
  (`alfworld/gen/layouts/FloorPlan*-openable.json`) and object classes (`*-objects.json`), the containment and
  affordance tables of `alfworld.gen.constants`, and the goal formula and wording of `alfworld.gen.goal_library`.
  Generated games lack ALFRED's 3-D geometry (no distances, one location per receptacle) and human-written goals.

The package is an optional extra: `pip install raygent[alfworld]`. Constructing the env never needs it (so
`raygent envs` lists it everywhere); the first `reset` imports it and says how to install it when missing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import CHARSET, Outcome, TextEnv

TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")
INSTALL_HINT = "the alfworld env needs the alfworld package: pip install 'raygent[alfworld]' (or pip install alfworld)"

# The appliance each state-change task uses; the domain's Heat/Cool/CleanObject name these receptacle types.
_APPLIANCE = {
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable", "ishot"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable", "iscool"),
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable", "isclean"),
}
_LAMPS = ("DeskLamp", "FloorLamp")
# Held-out floor plans for the generated `valid_unseen` split: the first three of each room kind.
_UNSEEN_OFFSETS = (1, 2, 3)
_PRINTABLE = frozenset(CHARSET)


def _alfworld():
    """Import the engine pieces, or fail with the install command."""
    try:
        import alfworld
        import alfworld.gen.constants as constants
        import alfworld.gen.goal_library as goal_library
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
        from textworld.envs import PddlEnv
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return alfworld, constants, goal_library, textworld, AlfredDemangler, PddlEnv


def alfworld_task_success(infos: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Success rate per task type from the final `info` of each episode (any order, any mix of types).

    Keys are the task types present plus "all"; values are the fraction of episodes with `info["won"]`. The
    controller passes the last info of every validation episode; `info["goal_condition_success"]` gives the
    partial-credit version when averaged the same way.
    """
    wins: dict[str, list[bool]] = defaultdict(list)
    for info in infos:
        wins[info["task_type"]].append(bool(info["won"]))
        wins["all"].append(bool(info["won"]))
    return {task: float(np.mean(won)) for task, won in sorted(wins.items())}


# ---- generated task instances --------------------------------------------------------------------------------
def _pddl_name(thor_id: str) -> str:
    """ALFRED's id mangling (`PlannedGameState.fix_pddl_str_chars`), which `AlfredDemangler` undoes."""
    for char, word in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        thor_id = thor_id.replace(char, word)
    return thor_id


def _receptacle_type(thor_id: str) -> str:
    parts = thor_id.split("|")  # "Sink|x|y|z|SinkBasin" names its basin last; others their class first
    return parts[-1] if len(parts) == 5 else parts[0]


@lru_cache(maxsize=1)
def _package_files() -> dict[str, Any]:
    """Domain, grammar and every floor plan's receptacles and object classes, read once from the wheel."""
    alfworld, constants, *_ = _alfworld()
    root = Path(alfworld.__file__).parent
    layouts = {}
    for path in sorted((root / "gen" / "layouts").glob("FloorPlan*-openable.json")):
        plan = path.name.split("-")[0]
        number = int(plan.removeprefix("FloorPlan"))
        layouts[number] = (sorted(json.loads(path.read_text())), sorted(set(json.loads(
            (path.parent / f"{plan}-objects.json").read_text()))))
    rooms = {number: room for room, numbers in constants.SCENE_TYPE.items() for number in numbers}
    return {
        "domain": (root / "data" / "alfred.pddl").read_text(),
        "grammar": (root / "data" / "alfred.twl2").read_text(),
        "layouts": layouts,
        "rooms": rooms,
    }


def generate_game(rng: np.random.Generator, task_type: str, split: str = "train") -> tuple[dict, dict]:
    """Write one solvable ALFWorld game of `task_type`, drawing only from `rng`.

    Returns `(game, task)`: `game` is the game.tw-pddl content the engine loads (domain, grammar with the goal
    sentence, PDDL problem); `task` holds the task type, targets, floor plan and goal sentence.
    """
    _, constants, goal_library, *_ = _alfworld()
    files = _package_files()
    plans = [n for n in files["layouts"] if files["rooms"].get(n) in constants.GOALS_VALID[task_type]]
    unseen = {constants.SCENE_TYPE[room].start + k - 1 for room in constants.GOALS_VALID[task_type]
              for k in _UNSEEN_OFFSETS}
    plans = [n for n in plans if (n in unseen) == (split == "valid_unseen")]
    for _ in range(1000):  # rejection sampling: a few floor plans lack what a task needs (a lamp, a fridge, ...)
        task = _draw_task(rng, task_type, int(plans[int(rng.integers(len(plans)))]), files, constants)
        if task is not None:
            break
    else:  # pragma: no cover - every task type has many feasible floor plans
        raise RuntimeError(f"could not generate a {task_type} task")
    names = {k: (v or "").lower() for k, v in task["pddl_params"].items()}
    template = goal_library.gdict[task_type]["templates"][int(rng.integers(2))]
    task["goal"] = template.format(obj=names["object_target"], recep=names["parent_target"],
                                   toggle=names["toggle_target"], mrecep="")
    goal = goal_library.gdict[task_type]["pddl"].format(
        obj=task["pddl_params"]["object_target"], recep=task["pddl_params"]["parent_target"],
        toggle=task["pddl_params"]["toggle_target"], mrecep="").replace("#", "-")
    game = {
        "pddl_domain": files["domain"],
        "grammar": files["grammar"].replace("UNKNOWN GOAL", task["goal"]),
        "pddl_problem": task.pop("problem_head") + goal,  # the library's goal closes the (define ...) too
        "solvable": True,
    }
    return game, task


def _draw_task(rng: np.random.Generator, task_type: str, plan: int, files: dict, constants: Any) -> dict | None:
    """One attempt at a task in floor plan `plan`; None when the plan cannot host `task_type`."""
    receptacle_ids, classes = files["layouts"][plan]
    static = set(constants.RECEPTACLES) - constants.MOVABLE_RECEPTACLES_SET
    receptacles = {_pddl_name(r): _receptacle_type(r) for r in receptacle_ids}
    for cls in classes:  # appliances the layout has but lists no interaction point for (stove, toaster, bin)
        if cls in static and cls not in receptacles.values():
            receptacles[f"{cls}_bar_00"] = cls
    holders = {cls: sorted(r for r, rt in receptacles.items() if cls in constants.VAL_RECEPTACLE_OBJECTS.get(rt, ()))
               for cls in classes}
    pickable = [c for c in classes if c in constants.OBJECTS and c not in static and holders.get(c)
                and c not in _LAMPS]
    present = set(receptacles.values())

    # Targets: what the goal mentions, drawn among what this floor plan can satisfy.
    appliance, affordance, _ = _APPLIANCE.get(task_type, (None, None, None))
    if appliance is not None and appliance not in present:
        return None
    candidates = [c for c in pickable if affordance is None or c in constants.VAL_ACTION_OBJECTS[affordance]]
    lamps = [c for c in classes if c in _LAMPS]
    lamp_stands = sorted(r for r, rt in receptacles.items() if rt not in constants.OPENABLE_CLASS_SET)
    if not candidates or (task_type == "look_at_obj_in_light" and not (lamps and lamp_stands)):
        return None
    obj = candidates[int(rng.integers(len(candidates)))]
    parent = toggle = None
    if task_type == "look_at_obj_in_light":
        toggle = lamps[int(rng.integers(len(lamps)))]
        sources = holders[obj]
    else:
        parents = sorted({rt for rt in present if obj in constants.VAL_RECEPTACLE_OBJECTS.get(rt, ())} - {appliance})
        if not parents:
            return None
        parent = parents[int(rng.integers(len(parents)))]
        sources = [r for r in holders[obj] if receptacles[r] != parent]  # the goal must not hold at the start
    if not sources:
        return None

    # Objects: one of each class the floor plan has, more of the target (two tasks need two).
    placed: dict[str, tuple[str, str]] = {}
    for cls in pickable:
        if cls == obj:
            count = int(rng.integers(2, 4)) if task_type == "pick_two_obj_and_place" else int(rng.integers(1, 3))
            spots = sources
        else:
            count, spots = 1, holders[cls]
        for k in range(count):
            placed[f"{cls}_bar_{k + 1:02d}"] = (cls, spots[int(rng.integers(len(spots)))])
    if toggle is not None:
        placed[f"{toggle}_bar_01"] = (toggle, lamp_stands[int(rng.integers(len(lamp_stands)))])

    locations = {r: f"loc_bar_{i:02d}" for i, r in enumerate(sorted(receptacles))}
    init = ["(atLocation agent1 loc_bar_start)"]
    for r, rt in sorted(receptacles.items()):
        init += [f"(receptacleAtLocation {r} {locations[r]})", f"(receptacleType {r} {rt}Type)"]
        if rt in constants.OPENABLE_CLASS_SET:
            init.append(f"(openable {r})")
    for o, (cls, r) in sorted(placed.items()):
        init += [f"(objectType {o} {cls}Type)", f"(inReceptacle {o} {r})", f"(objectAtLocation {o} {locations[r]})"]
        if cls in _LAMPS:
            init.append(f"(toggleable {o})")
            continue
        init.append(f"(pickupable {o})")
        for predicate, key in (("heatable", "Heatable"), ("coolable", "Coolable"), ("cleanable", "Cleanable"),
                               ("sliceable", "Sliceable")):
            if cls in constants.VAL_ACTION_OBJECTS[key]:
                init.append(f"({predicate} {o})")
        if cls in constants.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {o})")
    object_classes = sorted({cls for cls, _ in placed.values()} | {"Knife", "ButterKnife"})  # the domain names both
    receptacle_classes = sorted(present | {"SinkBasin", "Microwave", "Fridge"})
    for rt in sorted(present):
        init += [f"(canContain {rt}Type {c}Type)" for c in object_classes
                 if c in constants.VAL_RECEPTACLE_OBJECTS.get(rt, ())]
    declared = (["agent1 - agent", "loc_bar_start - location"]
                + [f"{loc} - location" for loc in sorted(locations.values())]
                + [f"{r} - receptacle" for r in sorted(receptacles)]
                + [f"{o} - object" for o in sorted(placed)]
                + [f"{c}Type - otype" for c in object_classes]
                + [f"{c}Type - rtype" for c in receptacle_classes])
    head = (f"(define (problem raygent_{task_type}_FloorPlan{plan})\n(:domain alfred)\n(:objects\n    "
            + "\n    ".join(declared) + "\n)\n(:init\n    " + "\n    ".join(init) + "\n)\n")
    return {
        "task_type": task_type,
        "pddl_params": {"object_target": obj, "parent_target": parent or "", "toggle_target": toggle or "",
                        "mrecep_target": "", "object_sliced": False},
        "scene": f"FloorPlan{plan}",
        "problem_head": head,
    }


# ---- official game files -------------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def _official_games(root: str, task_types: tuple[str, ...]) -> tuple[str, ...]:
    """Sorted game files under `root` of the wanted types, skipping what alfworld skips (movable, sliced)."""
    games = []
    for dirpath, _, filenames in os.walk(root):
        if "game.tw-pddl" not in filenames or "traj_data.json" not in filenames:
            continue
        if "movable" in dirpath or "Sliced" in dirpath:
            continue
        if Path(dirpath).parent.name.split("-")[0] in task_types:  # <task_type>-<obj>-<mrecep>-<recep>-<scene>
            games.append(os.path.join(dirpath, "game.tw-pddl"))
    return tuple(sorted(games))


class AlfWorld(TextEnv):
    """One ALFWorld task per episode on the TextWorld PDDL engine.

    Rewards: `success_reward` (default 1) on the winning step, which ends the episode; with `goal_condition_reward`
    > 0, also that much times each newly reached share of the goal's conditions (ALFRED's goal-condition
    success: e.g. "the apple is hot", then "a hot apple is on the countertop"). Invalid replies earn
    `invalid_reward` (0; the trainer sees `info["is_action_valid"]`).
    `info` adds `task_type`, `goal_condition_success` (share of goal conditions holding now) and `gamefile`.
    """

    name = "alfworld"
    task_description = (
        "ALFWorld: you are in a house. Go to receptacles, open them, take and move objects, heat, cool or clean "
        "them with the microwave, fridge or sinkbasin, and use lamps, to do the task the observation states."
    )
    example_action = "go to countertop 1"
    max_steps = 50
    invalid_reward = 0.0
    # ALFWorld's own held-out splits: seen floor plans, and floor plans training never visits
    heldout_splits = {"valid_seen": {"split": "valid_seen"}, "valid_unseen": {"split": "valid_unseen"}}

    def __init__(
        self,
        split: str = "train",
        task_types: Iterable[str] | None = None,
        data_path: str | None = None,
        max_steps: int | None = None,
        success_reward: float = 1.0,
        goal_condition_reward: float = 0.0,
        max_obs_chars: int = 2048,
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.task_types = tuple(TASK_TYPES if task_types is None else task_types)
        unknown = set(self.task_types) - set(TASK_TYPES)
        if unknown or not self.task_types:
            raise ValueError(f"task_types must be a non-empty subset of {TASK_TYPES}, got {sorted(unknown)}")
        super().__init__(max_steps=max_steps, max_obs_chars=max_obs_chars)
        self.split = split
        self.data_path = data_path  # None: $ALFWORLD_DATA when it holds json_2.1.1/<split>, else generated games
        self.success_reward = success_reward
        self.goal_condition_reward = goal_condition_reward
        self._engine: Any = None  # AlfredDemangler(PddlEnv), built on the first reset
        self._pddl_env: Any = None
        self._state: Any = None
        self._loaded: dict | None = None
        self._task: dict[str, Any] = {}
        self._gamefile: str | None = None
        self._feedback = ""
        self._plan: list[str] | None = None
        self._best_conditions = 0.0

    # ---- TextEnv hooks -------------------------------------------------------------------------------------------
    def _new_episode(self, options: dict[str, Any] | None) -> None:
        *_, textworld, demangler, pddl_env = _alfworld()
        if self._engine is None:
            self._pddl_env = pddl_env(textworld.EnvInfos(admissible_commands=True, won=True))
            self._engine = demangler(self._pddl_env, shuffle=False)
        task_type = (options or {}).get("task_type")
        if task_type is None:
            task_type = self.task_types[int(self.np_random.integers(len(self.task_types)))]
        elif task_type not in TASK_TYPES:
            raise ValueError(f"options['task_type'] must be one of {TASK_TYPES}, got {task_type!r}")
        root = self._official_root()
        game = self._official_game(root, task_type) if root else self._generated_game(task_type)
        if game is not self._loaded and game != self._loaded:  # the same game again (same seed): skip re-grounding
            self._engine.load(game)
            self._loaded = game
        self._state = self._engine.reset()
        self._feedback = self._state.feedback
        self._plan = None
        self._best_conditions = 0.0

    def _observe(self) -> str:
        text = self._feedback.strip()
        if "Your task is to:" not in text:  # steps after the intro restate the goal: prompts carry no history
            text = f"{text}\n\nYour task is to: {self._task.get('goal', '')}."
        return _sanitize(text, self.observation_space.max_length)

    def admissible_actions(self) -> list[str]:
        return list(self._state["admissible_commands"]) if self._state is not None else []

    def _apply(self, action: str) -> Outcome:
        self._state, _, _ = self._engine.step(action)
        self._feedback = self._state.feedback
        if self._plan and self._plan[0] == action:
            self._plan.pop(0)  # following the plan: the rest of it still holds
        else:
            self._plan = None
        won = bool(self._state["won"])
        progress = 1.0 if won else self.goal_condition_success()
        reward = self.goal_condition_reward * max(0.0, progress - self._best_conditions)
        self._best_conditions = max(self._best_conditions, progress)
        if won:
            return Outcome(reward + self.success_reward, terminated=True, won=True, key_event="finished the task")
        return Outcome(reward)

    def expert_action(self) -> str | None:
        """The next command of a fast-downward plan from the current state (replanned only off the plan)."""
        if self._state is None or self._state["won"]:
            return None
        if not self._plan or self._plan[0] not in self._state["admissible_commands"]:
            self._plan = list(self._pddl_env._pddl_state.replan(self._pddl_env._entity_infos))
        return self._plan[0] if self._plan else None

    def _info(self, action: str | None, valid: bool, key_event: str | None) -> dict[str, Any]:
        info = super()._info(action, valid, key_event)
        info["task_type"] = self._task.get("task_type")
        info["goal_condition_success"] = 1.0 if self._won else self.goal_condition_success()
        info["gamefile"] = self._gamefile
        return info

    # ---- goal conditions -----------------------------------------------------------------------------------------
    def goal_condition_success(self) -> float:
        """Share of the task's goal conditions that hold now (ALFRED's goal-condition success, 0..1)."""
        if self._state is None or not self._task:
            return 0.0
        facts: dict[str, set[tuple[str, ...]]] = defaultdict(set)
        for fact in self._state["_facts"]:
            facts[fact.name.lower()].add(tuple(v.name.lower() for v in fact.arguments))
        params = {k: (v or "").lower() + "type" for k, v in self._task["pddl_params"].items() if isinstance(v, str)}
        of_type = {o for o, t in facts["objecttype"] if t == params["object_target"]}
        task_type = self._task["task_type"]
        if task_type == "look_at_obj_in_light":
            lamps = {o for o, t in facts["objecttype"] if t == params["toggle_target"]}
            holding = any(o in of_type for _, o in facts["holds"])
            lit = any(o in lamps for (o,) in facts["istoggled"])
            return (holding + lit) / 2
        parents = {r for r, t in facts["receptacletype"] if t == params["parent_target"]}
        placed = {o for o, r in facts["inreceptacle"] if o in of_type and r in parents}
        if task_type == "pick_and_place_simple":
            return float(len(placed) >= 1)
        if task_type == "pick_two_obj_and_place":
            return min(len(placed), 2) / 2
        changed = {o for (o,) in facts[_APPLIANCE[task_type][2]] if o in of_type}
        return (bool(changed) + bool(placed & changed)) / 2

    # ---- where games come from -----------------------------------------------------------------------------------
    def _generated_game(self, task_type: str) -> dict:
        rng = np.random.default_rng(self.np_random.integers(2**63))
        game, self._task = generate_game(rng, task_type, self.split)
        self._gamefile = f"generated:{self._task['scene']}"
        return game

    def _official_root(self) -> str | None:
        """The split's folder of official games, or None to generate. An explicit `data_path` must hold it.

        Read at each reset, not at construction: `import alfworld` sets ALFWORLD_DATA to ~/.cache/alfworld
        when unset, which is why a folder without json_2.1.1 counts as "no official data".
        """
        base = self.data_path if self.data_path is not None else os.environ.get("ALFWORLD_DATA")
        if not base:
            return None
        root = os.path.join(os.path.expanduser(os.path.expandvars(base)), "json_2.1.1", self.split)
        if os.path.isdir(root):
            return root
        if self.data_path is not None:
            raise FileNotFoundError(f"data_path={self.data_path!r} has no json_2.1.1/{self.split} folder")
        return None

    def _official_game(self, root: str, task_type: str) -> dict:
        games = _official_games(root, (task_type,))
        if not games:
            raise FileNotFoundError(f"no {task_type} games under {root} (expected <task>/<trial>/game.tw-pddl)")
        for _ in range(100):  # unsolvable games (alfworld-generate marks them) are drawn again
            path = games[int(self.np_random.integers(len(games)))]
            with open(path) as f:
                game = json.load(f)
            if game.get("solvable", True):
                break
        with open(os.path.join(os.path.dirname(path), "traj_data.json")) as f:
            traj = json.load(f)
        goal = game["grammar"].split("Your task is to: ", 1)[-1].split('"', 1)[0].rstrip(".")
        self._task = {"task_type": traj["task_type"], "pddl_params": traj["pddl_params"], "goal": goal,
                      "scene": f"FloorPlan{traj.get('scene', {}).get('floor_plan', '')}"}
        self._gamefile = path
        return game


def _sanitize(text: str, max_chars: int) -> str:
    """Keep the observation inside the space: tabs to spaces, other strays to '?', cut to `max_chars`."""
    text = "".join(c if c in _PRINTABLE else (" " if c == "\t" else "?") for c in text)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."
