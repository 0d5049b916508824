"""Sokoban: generation, the BFS solver, and hand-checked rewards."""

from __future__ import annotations

import numpy as np
import pytest

from envs.sokoban import Sokoban, generate_room, parse_grid, push, render_grid, solve


def act(action: str) -> str:
    return f"<action>{action}</action>"


def test_default_rooms_are_unsolved_solvable_and_short() -> None:
    lengths = []
    for seed in range(300):
        room = generate_room(np.random.default_rng(seed))
        assert not room.solved and len(room.boxes) == 1
        assert parse_grid(render_grid(room)) == room
        plan = solve(room)
        assert plan is not None
        lengths.append(len(plan))
    assert 1 <= min(lengths) and max(lengths) <= 15


def test_env_rooms_are_solved_by_replaying_the_plan() -> None:
    env = Sokoban()
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        plan = solve(obs)
        total = 0.0
        for i, move in enumerate(plan):
            obs, reward, terminated, truncated, info = env.step(act(move))
            total += reward
            assert terminated == (i == len(plan) - 1) and not truncated
        assert info["won"] and info["key_event"] == "all boxes on targets"
        # -0.1 a step, then +1 (box onto target) +10 (solved): an optimal plan never pushes the box off it.
        assert total == pytest.approx(11.0 - 0.1 * len(plan))


@pytest.mark.parametrize(("dim_room", "num_boxes"), [((7, 7), 1), ((8, 8), 2)])
def test_bigger_rooms_get_interior_walls_and_stay_solvable(dim_room: tuple[int, int], num_boxes: int) -> None:
    height, width = dim_room
    for seed in range(15):
        room = generate_room(np.random.default_rng(seed), dim_room, num_boxes)
        assert len(room.walls) > 2 * (height + width) - 4  # more than the border
        assert len(room.boxes) == len(room.targets) == num_boxes and not room.solved
        assert solve(room) is not None


def test_hand_checked_single_push_to_finish() -> None:
    env = Sokoban()
    obs, _ = env.reset(options={"grid": "######\n#PX_O#\n######"})
    assert obs == "######\n#PX_O#\n######"
    obs, reward, terminated, _, info = env.step(act("right"))
    assert obs == "######\n#_PXO#\n######"
    assert reward == pytest.approx(-0.1) and not terminated and "key_event" not in info
    obs, reward, terminated, truncated, info = env.step(act("right"))
    assert obs == "######\n#__P√#\n######"
    assert reward == pytest.approx(10.9) and terminated and not truncated
    assert info["won"] and info["anchor"] == obs


def test_hand_checked_box_on_and_off_target() -> None:
    env = Sokoban()
    env.reset(options={"grid": "#######\n#P√_O_#\n#___X_#\n#######"})
    obs, reward, terminated, _, info = env.step(act("right"))
    assert obs == "#######\n#_SXO_#\n#___X_#\n#######"
    assert reward == pytest.approx(-1.1) and info["key_event"] == "box pushed off target" and not terminated
    obs, reward, terminated, _, info = env.step(act("right"))
    assert obs == "#######\n#_OP√_#\n#___X_#\n#######"
    assert reward == pytest.approx(0.9) and info["key_event"] == "box pushed onto target" and not terminated


def test_pushing_into_wall_or_box_is_valid_but_moves_nothing() -> None:
    env = Sokoban()
    for grid in ["####\n#PX#\n#O_#\n####", "#######\n#PXX_O#\n#____O#\n#######"]:
        obs, _ = env.reset(options={"grid": grid})
        new_obs, reward, terminated, _, info = env.step(act("right"))
        assert new_obs == obs and info["is_action_valid"] and reward == pytest.approx(-0.1) and not terminated


def test_solver_edge_cases() -> None:
    assert solve("####\n#P√#\n####") == []
    assert solve("######\n#PX_O#\n######") == ["right", "right"]
    assert solve("####\n#X_#\n#_P#\n#O_#\n####") is None  # box stuck in a corner
    assert solve("######\n#PX_O#\n######", max_depth=1) is None
    room = parse_grid("#######\n#P_X_O#\n#######")
    assert solve(room) == solve(render_grid(room)) == ["right", "right", "right"]
    assert push(room, "left") == room


def test_expert_follows_an_optimal_plan() -> None:
    env = Sokoban()
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        assert env.expert_action() == solve(obs)[0]


@pytest.mark.parametrize("grid", ["##\n#", "#P#\n#Q#", "###\n#_#\n###", "#PP#"])
def test_parse_grid_rejects_bad_grids(grid: str) -> None:
    with pytest.raises(ValueError):
        parse_grid(grid)


def test_bad_room_sizes_raise() -> None:
    with pytest.raises(ValueError):
        generate_room(np.random.default_rng(0), (3, 3), num_boxes=1)
    with pytest.raises(ValueError):
        Sokoban(dim_room=(4, 4), num_boxes=4)


def test_position_lines_absolute_and_relative() -> None:
    grid = "######\n#O___#\n#____#\n#XP__#\n######"
    absolute, _ = Sokoban(show_positions=True).reset(options={"grid": grid})
    assert absolute == grid + "\nYou: row 3 col 2. Boxes: row 3 col 1. Targets: row 1 col 1."
    env = Sokoban(show_positions="relative")
    relative, _ = env.reset(options={"grid": grid})
    assert relative == grid + "\nBoxes: 0 down 1 left of you. Targets: 2 up 0 right of the box."
    relative, *_ = env.step(act("up"))
    assert relative.endswith("Boxes: 1 down 1 left of you. Targets: 2 up 0 right of the box.")
    two_boxes, _ = env.reset(options={"grid": "#######\n#PX_XO#\n#____O#\n#######"})
    assert two_boxes.endswith("Boxes: 0 down 1 right, 0 down 3 right of you. Targets: 0 down 4 right, "
                              "1 down 4 right of you.")
    with pytest.raises(ValueError, match="allowed"):
        Sokoban(show_positions="grid")
