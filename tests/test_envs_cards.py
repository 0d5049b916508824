"""The gym-cards family: formula arithmetic, the formula grammar, rewards, and the Blackjack expert."""

from __future__ import annotations

import operator
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.gym_cards import Blackjack, EZPoints, NumberLine, Points24, evaluate_formula, formula_solutions, hand_total


def act(action: str) -> str:
    return f"<action>{action}</action>"


# ---- formula arithmetic ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("formula", "value"),
    [
        ("2 + 3 * 4", Fraction(14)),
        ("( 2 + 3 ) * 4", Fraction(20)),
        ("8 / 3", Fraction(8, 3)),
        ("8 - 3 - 2", Fraction(3)),
        ("8 / ( 3 - 8 / 3 )", Fraction(24)),
        ("( ( 7 ) )", Fraction(7)),
    ],
)
def test_evaluate_formula_values(formula: str, value: Fraction) -> None:
    assert evaluate_formula(formula.split()) == value


@pytest.mark.parametrize("formula", ["", "+", "2 3", "( 2", "2 )", "2 +", "1 / ( 2 - 2 )", "² + 1", "( )", "2 = 2"])
def test_evaluate_formula_rejects_malformed(formula: str) -> None:
    assert evaluate_formula(formula.split()) is None


_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
# An expression tree as (tokens, exact value), fully parenthesised so the parser's precedence cannot matter.
_LEAVES = st.integers(1, 13).map(lambda n: ([str(n)], Fraction(n)))


def _join(pair: tuple, op: str) -> tuple[list[str], Fraction | None]:
    (left, lv), (right, rv) = pair
    tokens = ["(", *left, op, *right, ")"]
    if lv is None or rv is None or (op == "/" and rv == 0):
        return tokens, None  # dividing by zero anywhere makes the whole formula invalid
    return tokens, _ARITHMETIC[op](lv, rv)


_TREES = st.recursive(
    _LEAVES,
    lambda inner: st.builds(_join, st.tuples(inner, inner), st.sampled_from("+-*/")),
    max_leaves=8,
)


@given(_TREES)
def test_evaluate_formula_matches_exact_arithmetic(tree: tuple[list[str], Fraction | None]) -> None:
    tokens, value = tree
    assert evaluate_formula(tokens) == value


def test_formula_solutions_are_correct_and_use_every_card_once() -> None:
    for hand in [(3, 3, 8, 8), (1, 5, 5, 5), (10, 10, 4, 4), (1, 2, 3, 4)]:
        solutions = formula_solutions(hand, 24)
        assert solutions
        for tokens in solutions:
            assert evaluate_formula(tokens) == 24
            assert sorted(int(t) for t in tokens if t.isdigit()) == sorted(hand)
    assert ("8", "/", "(", "3", "-", "8", "/", "3", ")") in formula_solutions((3, 3, 8, 8), 24)
    assert formula_solutions((1, 1, 1, 1), 24) == ()
    assert set(formula_solutions((6, 2), 12, "+*", parentheses=False)) == {("2", "*", "6"), ("6", "*", "2")}


# ---- EZPoints and Points24 -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cls", "n_cards"), [(EZPoints, 2), (Points24, 4)])
def test_only_solvable_hands_are_dealt(cls: type, n_cards: int) -> None:
    env = cls()
    for seed in range(100):
        env.reset(seed=seed)
        assert len(env.cards) == n_cards and all(1 <= c <= 10 for c in env.cards)
        assert formula_solutions(env.cards, env.target, env.operators, env.parentheses)


def test_ezpoints_grammar_and_rewards() -> None:
    env = EZPoints()
    env.reset(seed=0)
    a, b = env.cards
    assert env.admissible_actions() == [str(v) for v in sorted({a, b})]
    absent = next(str(v) for v in range(1, 11) if v not in (a, b))
    obs = env.render()
    _, reward, terminated, _, info = env.step(act(absent))  # a card not in the hand is an illegal token
    assert reward == -1.0 and not terminated and not info["is_action_valid"] and env.render() == obs
    _, reward, _, _, info = env.step(act(str(a)))
    assert reward == 0.0 and info["is_action_valid"]
    assert env.admissible_actions() == ["+", "*", "="]
    _, reward, terminated, _, info = env.step(act("="))  # submitting with a card unused is wrong
    assert reward == -1.0 and terminated and not info["won"]


def test_points24_parentheses_grammar() -> None:
    env = Points24()
    env.reset(seed=0)
    assert "(" in env.admissible_actions() and ")" not in env.admissible_actions()
    env.step(act("("))
    card = env.admissible_actions()[0]
    env.step(act(card))
    legal = env.admissible_actions()
    assert ")" in legal and "=" not in legal and "(" not in legal
    _, reward, _, _, info = env.step(act("="))
    assert reward == -1.0 and not info["is_action_valid"]
    assert env.formula == ["(", card]


def test_points24_correct_formula_pays_ten() -> None:
    env = Points24()
    env.reset(seed=5)
    solution = formula_solutions(env.cards, 24)[0]
    rewards = [env.step(act(token))[1] for token in solution]
    _, reward, terminated, _, info = env.step(act("="))
    assert rewards == [0.0] * len(solution) and reward == 10.0 and terminated and info["won"]


# ---- NumberLine --------------------------------------------------------------------------------------------------
def test_numberline_rewards() -> None:
    env = NumberLine(max_position=5)
    assert env.max_steps == 10
    env.reset(seed=0)
    env.current, env.target = 0, 2
    _, reward, *_ = env.step(act("-"))  # clipped at 0: no closer
    assert reward == -1.0 and env.current == 0
    _, reward, terminated, *_ = env.step(act("+"))
    assert reward == 0.0 and not terminated
    _, reward, terminated, _, info = env.step(act("+"))
    assert reward == 1.0 and terminated and info["won"]


# ---- Blackjack ---------------------------------------------------------------------------------------------------
def test_hand_total() -> None:
    assert hand_total([1, 6]) == (17, True)
    assert hand_total([1, 6, 10]) == (17, False)
    assert hand_total([1, 1, 9]) == (21, True)
    assert hand_total([10, 10, 5]) == (25, False)


def _mean_return_and_win_rate(policy: str, seeds: range) -> tuple[float, float]:
    env = Blackjack()
    returns, wins = [], []
    for seed in seeds:
        env.reset(seed=seed)
        total, done, info = 0.0, False, {}
        while not done:
            action = env.expert_action() if policy == "expert" else "stand"
            _, reward, terminated, truncated, info = env.step(act(action))
            total, done = total + reward, terminated or truncated
        returns.append(total)
        wins.append(info["won"])
    return float(np.mean(returns)), float(np.mean(wins))


def test_blackjack_expert_beats_always_standing() -> None:
    # Measured over these seeds: basic strategy returns about -0.04 a hand, always standing about -0.16.
    seeds = range(3000)
    expert_return, expert_wins = _mean_return_and_win_rate("expert", seeds)
    stand_return, stand_wins = _mean_return_and_win_rate("stand", seeds)
    assert expert_return > stand_return + 0.08
    assert expert_wins > stand_wins


def test_blackjack_bust_and_terminal_observation() -> None:
    env = Blackjack()
    env.reset(seed=0)
    env.player, env.dealer = [10, 6, 5], [9, 7]  # a hard 21: any card busts it
    obs, reward, terminated, _, info = env.step(act("hit"))
    assert hand_total(env.player)[0] > 21
    assert reward == -1.0 and terminated and not info["won"] and info["key_event"] == "bust"
    assert "Dealer cards: 9, 7 (total 16)" in obs and env.admissible_actions() == []
