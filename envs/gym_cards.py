"""The gym-cards family (RL4VLM) with text observations: NumberLine, EZPoints, Points24 and Blackjack.

Rewards follow gym-cards: a correct formula earns +10, a wrong final answer -1, and every invalid reply (no
``<action>`` tag, or a token that is not legal right now) -1 with the state unchanged. Formulas are evaluated
exactly with `fractions.Fraction` by a small recursive-descent parser, never with `eval`.

Cards are drawn from an infinite deck, ranks A..K with J, Q, K worth 10 and A worth 1 (11 in Blackjack when
that does not bust), and are shown by value (an ace as ``A`` in Blackjack).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from envs.base import Outcome, TextEnv

# ---- exact formula arithmetic -----------------------------------------------------------------------------------

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


class _SyntaxError(Exception):
    pass


def evaluate_formula(tokens: Sequence[str]) -> Fraction | None:
    """Exact value of an infix formula given as tokens (numbers, + - * /, parentheses); None if malformed or if
    it divides by zero. Grammar: sum := product (('+'|'-') product)*; product := atom (('*'|'/') atom)*;
    atom := NUMBER | '(' sum ')'."""
    try:
        value, end = _parse_sum(tokens, 0)
    except (_SyntaxError, ZeroDivisionError, RecursionError):
        return None
    return value if end == len(tokens) else None


def _parse_sum(tokens: Sequence[str], pos: int) -> tuple[Fraction, int]:
    value, pos = _parse_product(tokens, pos)
    while pos < len(tokens) and tokens[pos] in ("+", "-"):
        right, end = _parse_product(tokens, pos + 1)
        value, pos = _ARITHMETIC[tokens[pos]](value, right), end
    return value, pos


def _parse_product(tokens: Sequence[str], pos: int) -> tuple[Fraction, int]:
    value, pos = _parse_atom(tokens, pos)
    while pos < len(tokens) and tokens[pos] in ("*", "/"):
        right, end = _parse_atom(tokens, pos + 1)
        value, pos = _ARITHMETIC[tokens[pos]](value, right), end
    return value, pos


def _parse_atom(tokens: Sequence[str], pos: int) -> tuple[Fraction, int]:
    if pos >= len(tokens):
        raise _SyntaxError("formula ends early")
    token = tokens[pos]
    if token == "(":
        value, pos = _parse_sum(tokens, pos + 1)
        if pos >= len(tokens) or tokens[pos] != ")":
            raise _SyntaxError("unclosed parenthesis")
        return value, pos + 1
    # isascii() first: str.isdigit() also accepts digits such as '²' that int() rejects.
    if token.isascii() and token.isdigit():
        return Fraction(int(token)), pos + 1
    raise _SyntaxError(f"unexpected token {token!r}")


def formula_solutions(
    values: Sequence[int], target: int, operators: str = "+-*/", parentheses: bool = True
) -> tuple[tuple[str, ...], ...]:
    """All formulas (token tuples, shortest first) that use each value exactly once and equal `target`."""
    return _solutions(tuple(sorted(values)), target, operators, parentheses)


@functools.lru_cache(maxsize=1024)
def _solutions(values: tuple[int, ...], target: int, operators: str, parentheses: bool) -> tuple[tuple[str, ...], ...]:
    if len(values) == 1:
        found = {(str(values[0]),)} if values[0] == target else set()
    else:
        found = {t for v, t, _ in _combinations(values, operators) if v == target and (parentheses or "(" not in t)}
    # Sorted, not set order: string hashing differs between processes and the expert must be deterministic.
    return tuple(sorted(found, key=lambda t: (len(t), t)))


@functools.lru_cache(maxsize=512)
def _expressions(values: tuple[int, ...], operators: str) -> tuple[tuple[Fraction, tuple[str, ...], int], ...]:
    """Every expression over the sorted multiset `values` as (value, tokens, precedence). Only sub-hands are
    cached here; a full four-card hand has ~7,700 expressions and is streamed by `_combinations` instead."""
    if len(values) == 1:
        return ((Fraction(values[0]), (str(values[0]),), 3),)
    return tuple({t: (v, t, p) for v, t, p in _combinations(values, operators)}.values())


def _combinations(values: tuple[int, ...], operators: str) -> Iterator[tuple[Fraction, tuple[str, ...], int]]:
    """Split `values` into every ordered (left, right) pair of sub-multisets and join their expressions with each
    operator, adding parentheses only where precedence needs them (so formulas stay short for a small model)."""
    n = len(values)
    for mask in range(1, (1 << n) - 1):
        left = tuple(v for i, v in enumerate(values) if mask >> i & 1)
        right = tuple(v for i, v in enumerate(values) if not mask >> i & 1)
        for lvalue, ltokens, lprec in _expressions(left, operators):
            for rvalue, rtokens, rprec in _expressions(right, operators):
                for op in operators:
                    prec = _PRECEDENCE[op]
                    if op == "/" and rvalue == 0:
                        continue
                    # The right side also needs parentheses at equal precedence under - and /: a-(b-c) != a-b-c.
                    lt = ("(", *ltokens, ")") if lprec < prec else ltokens
                    rt = ("(", *rtokens, ")") if rprec < prec or (rprec == prec and op in "-/") else rtokens
                    yield _ARITHMETIC[op](lvalue, rvalue), (*lt, op, *rt), prec


def _draw_value(rng: np.random.Generator) -> int:
    """One card from an infinite deck: rank 1..13, face cards worth 10."""
    return min(int(rng.integers(1, 14)), 10)


# ---- NumberLine -------------------------------------------------------------------------------------------------


class NumberLine(TextEnv):
    """Move the current number to the target on the line 0..max_position with "+" and "-".

    Rewards (gym-cards): +1 on reaching the target (terminates, won), -1 for a step that does not get closer
    (including a push past either end and an invalid reply), 0 otherwise. `max_steps` defaults to 2*max_position.
    """

    name = "numberline"
    task_description = "Number line: move Current to Target. '+' adds 1, '-' subtracts 1."
    example_action = "+"
    invalid_reward = -1.0

    def __init__(self, max_position: int = 5, max_steps: int | None = None):
        if max_position < 1:
            raise ValueError(f"max_position must be >= 1, got {max_position}")
        super().__init__(max_steps=2 * max_position if max_steps is None else max_steps, max_obs_chars=64)
        self.max_position = max_position
        self.current = self.target = 0

    def _new_episode(self, options: dict[str, Any] | None) -> None:
        self.current, self.target = (int(x) for x in self.np_random.choice(self.max_position + 1, 2, replace=False))

    def _observe(self) -> str:
        return f"Target: {self.target}\nCurrent: {self.current}"

    def admissible_actions(self) -> list[str]:
        return ["+", "-"]

    def _apply(self, action: str) -> Outcome:
        before = abs(self.current - self.target)
        self.current = min(max(self.current + (1 if action == "+" else -1), 0), self.max_position)
        after = abs(self.current - self.target)
        if after == 0:
            return Outcome(1.0, terminated=True, won=True, key_event="reached the target")
        return Outcome(0.0 if after < before else -1.0)

    def expert_action(self) -> str | None:
        if self.current == self.target:
            return None
        return "+" if self.current < self.target else "-"


# ---- EZPoints and Points24 --------------------------------------------------------------------------------------


class _FormulaGame(TextEnv):
    """Build a formula token by token from the dealt cards, each card used once, then "=" to submit.

    Only hands with at least one solution are dealt. Legal tokens follow the grammar: a card or "(" where an
    operand is expected; an operator (while cards remain), ")" (inside parentheses) or "=" (outside) after one.
    Rewards: 0 per legal token, +10 for "=" on a formula that uses every card and equals the target (won), -1
    for "=" on any other formula (terminates, lost), -1 for an invalid reply or illegal token (no change).
    """

    num_cards: int = 2
    target: int = 12
    operators: str = "+*"
    parentheses: bool = False
    invalid_reward = -1.0
    correct_reward = 10.0
    wrong_reward = -1.0

    def __init__(self, max_steps: int | None = None):
        super().__init__(max_steps=max_steps, max_obs_chars=256)
        self.cards: list[int] = []
        self.formula: list[str] = []

    def _new_episode(self, options: dict[str, Any] | None) -> None:
        while True:
            self.cards = [_draw_value(self.np_random) for _ in range(self.num_cards)]
            if self._solutions():
                break
        self.formula = []

    def _solutions(self) -> tuple[tuple[str, ...], ...]:
        return formula_solutions(self.cards, self.target, self.operators, self.parentheses)

    def _unused(self) -> list[int]:
        unused = list(self.cards)
        for token in self.formula:
            if token.isdigit():
                unused.remove(int(token))
        return unused

    def _observe(self) -> str:
        formula = " ".join(self.formula) if self.formula else "nothing yet"
        unused = " ".join(map(str, self._unused())) or "none"
        return (
            f"Cards: {' '.join(map(str, self.cards))}\nUnused cards: {unused}\n"
            f"Target: {self.target}\nFormula: {formula}"
        )

    def admissible_actions(self) -> list[str]:
        if self.formula and self.formula[-1] == "=":
            return []
        unused = self._unused()
        depth = self.formula.count("(") - self.formula.count(")")
        if not self.formula or self.formula[-1] in (*self.operators, "("):
            # An operand is expected. Operators are only offered while a card remains, so one always exists.
            actions = [str(v) for v in sorted(set(unused))]
            return actions + ["("] if self.parentheses else actions
        actions = list(self.operators) if unused else []
        return actions + [")" if depth > 0 else "="]

    def _apply(self, action: str) -> Outcome:
        self.formula.append(action)
        if action != "=":
            return Outcome(0.0)
        value = evaluate_formula(self.formula[:-1])
        if value == self.target and not self._unused():
            return Outcome(self.correct_reward, terminated=True, won=True, key_event=f"formula equals {self.target}")
        return Outcome(self.wrong_reward, terminated=True, key_event=f"wrong formula (value {value})")

    def expert_action(self) -> str | None:
        """The next token of the first known solution that extends the current formula, if any does."""
        done = tuple(self.formula)
        for solution in self._solutions():
            if solution[: len(done)] == done:
                return solution[len(done)] if len(solution) > len(done) else "="
        return None


class EZPoints(_FormulaGame):
    """Two cards; make 12 with + and * (rules and rewards: see `_FormulaGame`)."""

    name = "ezpoints"
    task_description = "Use both cards once each, with + and *, to make a formula equal to 12; then '='."
    example_action = "+"
    max_steps = 8


class Points24(_FormulaGame):
    """Four cards; make 24 with + - * / and parentheses (rules and rewards: see `_FormulaGame`)."""

    name = "points24"
    task_description = (
        "Use all four cards once each, with + - * / and parentheses, to make a formula equal to 24; then '='."
    )
    example_action = "+"
    max_steps = 20
    num_cards = 4
    target = 24
    operators = "+-*/"
    parentheses = True


# ---- Blackjack --------------------------------------------------------------------------------------------------


def hand_total(cards: Sequence[int]) -> tuple[int, bool]:
    """Best total of a hand and whether an ace counts as 11 in it (a "soft" hand)."""
    total = sum(cards)
    if 1 in cards and total + 10 <= 21:
        return total + 10, True
    return total, False


class Blackjack(TextEnv):
    """Beat the dealer without going over 21; actions "hit" and "stand".

    Standard rules without doubling, splitting or a natural bonus; the dealer draws below 17. Rewards: +1 win,
    -1 loss or bust, 0 draw (all at the end), -1 for an invalid reply (so stalling until truncation, which pays
    0, never beats playing).
    """

    name = "blackjack"
    task_description = "Blackjack: get closer to 21 than the dealer without going over. A counts 1 or 11."
    example_action = "hit"
    max_steps = 10
    invalid_reward = -1.0

    def __init__(self, max_steps: int | None = None):
        super().__init__(max_steps=max_steps, max_obs_chars=256)
        self.player: list[int] = []
        self.dealer: list[int] = []
        self.finished = False

    def _new_episode(self, options: dict[str, Any] | None) -> None:
        self.player = [_draw_value(self.np_random) for _ in range(2)]
        self.dealer = [_draw_value(self.np_random) for _ in range(2)]
        self.finished = False

    def _observe(self) -> str:
        total, soft = hand_total(self.player)
        lines = [f"Your cards: {_show(self.player)} (total {total}{', soft' if soft else ''})"]
        if self.finished:
            lines.append(f"Dealer cards: {_show(self.dealer)} (total {hand_total(self.dealer)[0]})")
        else:
            lines.append(f"Dealer shows: {_show(self.dealer[:1])}")
        return "\n".join(lines)

    def admissible_actions(self) -> list[str]:
        return [] if self.finished else ["hit", "stand"]

    def _apply(self, action: str) -> Outcome:
        if action == "hit":
            self.player.append(_draw_value(self.np_random))
            if hand_total(self.player)[0] > 21:
                self.finished = True
                return Outcome(-1.0, terminated=True, key_event="bust")
            return Outcome(0.0)
        while hand_total(self.dealer)[0] < 17:
            self.dealer.append(_draw_value(self.np_random))
        self.finished = True
        mine, theirs = hand_total(self.player)[0], hand_total(self.dealer)[0]
        if theirs > 21 or mine > theirs:
            return Outcome(1.0, terminated=True, won=True, key_event="won the hand")
        if mine == theirs:
            return Outcome(0.0, terminated=True, key_event="draw")
        return Outcome(-1.0, terminated=True, key_event="lost the hand")

    def expert_action(self) -> str | None:
        """Basic strategy without doubling or splitting."""
        if self.finished:
            return None
        total, soft = hand_total(self.player)
        up = self.dealer[0] if self.dealer[0] != 1 else 11
        if soft:
            return "hit" if total <= 17 or (total == 18 and up >= 9) else "stand"
        if total <= 11:
            return "hit"
        if total == 12:
            return "stand" if 4 <= up <= 6 else "hit"
        if total <= 16:
            return "stand" if up <= 6 else "hit"
        return "stand"


def _show(cards: Sequence[int]) -> str:
    return ", ".join("A" if c == 1 else str(c) for c in cards)
