"""Treasure hunt: the smallest complete raygent environment, and the template for writing your own.

To add an environment, copy this file, subclass `TextEnv`, set the class attributes and fill in the five hooks
below. The base class does the rest: it parses the model's reply (`<action>...</action>`), treats unknown or
missing actions as invalid without moving, counts steps, truncates at `max_steps`, and fills `info`.
Then either register it (`envs.register("my_env", "my_pkg.my_module:MyEnv")`) or pass the import path to
`envs.make("my_pkg.my_module:MyEnv")` directly; see envs/README.md.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from envs.base import Outcome, TextEnv

# Actions are plain words: the model writes them inside <action></action>, matched case-insensitively.
MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

Cell = tuple[int, int]  # (row, column)


class TreasureHunt(TextEnv):
    """Walk to the treasure T on a small grid with walls.

    Rewards: +1 on reaching the treasure (terminates, won); -0.05 for any other step, an invalid reply included.
    """

    # `name` is what `envs.make` looks up once the env is registered. `task_description` opens every prompt, so
    # keep it to one or two sentences that explain the symbols; a small model reads it at every step.
    name = "treasure_hunt"
    task_description = "Treasure hunt: you are P on a grid. Reach the treasure T. # is a wall, _ is floor."
    example_action = "up"
    max_steps = 20
    step_reward = -0.05
    invalid_reward = -0.05  # an invalid reply also costs a step, so stalling never pays

    def __init__(self, size: int = 5, num_walls: int = 4, max_steps: int | None = None):
        # Keyword arguments here are exactly what `make("treasure_hunt", size=..., ...)` forwards. Size the
        # observation space to the largest text `_observe` can return (a size x size grid plus newlines).
        if num_walls > size * size - 2:
            raise ValueError(f"a {size}x{size} grid has no room for {num_walls} walls, a player and a treasure")
        super().__init__(max_steps=max_steps, max_obs_chars=size * (size + 1))
        self.size = size
        self.num_walls = num_walls
        self.walls: set[Cell] = set()
        self.player: Cell = (0, 0)
        self.treasure: Cell = (0, 0)

    # ---- hook 1: a new initial state ----------------------------------------------------------------------------
    def _new_episode(self, options: dict[str, Any] | None) -> None:
        # Draw only from `self.np_random`: `reset(seed=...)` seeds it, which makes episodes reproducible and lets
        # every member of a GRPO/GiGPO group start from the same state.
        while True:
            order = self.np_random.permutation(self.size * self.size)
            cells = [divmod(int(i), self.size) for i in order[: self.num_walls + 2]]
            self.walls = set(cells[: self.num_walls])
            self.player, self.treasure = cells[-2], cells[-1]
            if self._shortest_path() is not None:  # reject layouts where walls cut the treasure off
                return

    # ---- hook 2: the state as text --------------------------------------------------------------------------
    def _observe(self) -> str:
        # Only the current state: no history (memory modules add that) and no instructions (the prompt does).
        # GiGPO groups steps on this text (`info["anchor"]`), so equal states must render identically.
        grid = [["_"] * self.size for _ in range(self.size)]
        for r, c in self.walls:
            grid[r][c] = "#"
        grid[self.treasure[0]][self.treasure[1]] = "T"
        grid[self.player[0]][self.player[1]] = "P"  # drawn last: on the winning step P covers T
        return "\n".join("".join(row) for row in grid)

    # ---- hook 3: the legal actions now -----------------------------------------------------------------------
    def admissible_actions(self) -> list[str]:
        # Walking into a wall is legal but does nothing (like bumping into it); only unknown words are invalid.
        return list(MOVES)

    # ---- hook 4: apply one valid action ----------------------------------------------------------------------
    def _apply(self, action: str) -> Outcome:
        nxt = self._neighbour(self.player, action)
        if nxt is not None:
            self.player = nxt
        if self.player == self.treasure:
            # `key_event` is an optional milestone sentence that memory modules can show the agent later.
            return Outcome(1.0, terminated=True, won=True, key_event="found the treasure")
        return Outcome(self.step_reward)

    # ---- hook 5: a good action (demonstrations for supervised warm start, and tests) ------------------------
    def expert_action(self) -> str | None:
        path = self._shortest_path()
        return path[0] if path else None

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _neighbour(self, cell: Cell, action: str) -> Cell | None:
        """The cell one move away, or None if that is off the grid or a wall."""
        r, c = cell[0] + MOVES[action][0], cell[1] + MOVES[action][1]
        if 0 <= r < self.size and 0 <= c < self.size and (r, c) not in self.walls:
            return (r, c)
        return None

    def _shortest_path(self) -> list[str] | None:
        """Breadth-first search from the player to the treasure; the list of moves, or None if unreachable."""
        came_from: dict[Cell, tuple[Cell, str] | None] = {self.player: None}
        queue = deque([self.player])
        while queue:
            cell = queue.popleft()
            if cell == self.treasure:
                path = []
                while came_from[cell] is not None:
                    cell, move = came_from[cell]
                    path.append(move)
                return path[::-1]
            for move in MOVES:
                nxt = self._neighbour(cell, move)
                if nxt is not None and nxt not in came_from:
                    came_from[nxt] = (cell, move)
                    queue.append(nxt)
        return None
