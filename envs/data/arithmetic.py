"""Multi-step arithmetic word problems in the manner of GSM8K (2-4 operations, whole-number answers), generated from
a seed, each with the expression that solves it; and the loader for GSM8K-format JSONL ("question", and "answer"
ending in "#### N")."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from envs.data import read_jsonl

NAMES = [("Lena", "she"), ("Omar", "he"), ("Priya", "she"), ("Tomas", "he"), ("Aiko", "she"), ("Malik", "he"),
         ("Sofia", "she"), ("Jonas", "he"), ("Ines", "she"), ("Kofi", "he")]
ITEMS = ["apples", "marbles", "stickers", "books", "cookies", "coins", "stamps", "pencils", "shells", "cards"]


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    expression: str = ""  # what the calculator should be asked; empty for loaded problems


def _wrap(expr: str) -> str:
    return expr if expr.isdigit() else f"({expr})"


def generate_problem(rng: np.random.Generator) -> Problem:
    """A chain of 2-4 operations on one quantity, every intermediate value a positive whole number."""
    name, he = NAMES[rng.integers(len(NAMES))]
    item = ITEMS[rng.integers(len(ITEMS))]
    He = he.capitalize()
    value = int(rng.integers(5, 60))
    expr = str(value)
    sentences = [f"{name} has {value} {item}."]
    n_ops, ops = int(rng.integers(2, 5)), 0
    while ops < n_ops:
        kind = ["add", "sub", "packs", "times", "share"][rng.integers(5)]
        if kind == "add":
            n = int(rng.integers(2, 40))
            sentences.append(f"A friend gives {name} {n} more {item}.")
            value, expr, ops = value + n, f"{expr} + {n}", ops + 1
        elif kind == "sub" and value > 3:
            n = int(rng.integers(1, value))
            sentences.append(f"{He} gives away {n} {item}.")
            value, expr, ops = value - n, f"{expr} - {n}", ops + 1
        elif kind == "packs" and ops + 2 <= n_ops:
            packs, each = int(rng.integers(2, 9)), int(rng.integers(2, 13))
            sentences.append(f"{He} buys {packs} packs with {each} {item} in each pack.")
            value, expr, ops = value + packs * each, f"{expr} + {packs} * {each}", ops + 2
        elif kind == "times" and value < 500:
            k = int(rng.integers(2, 4))
            sentences.append(f"Then the number of {item} {name} has becomes {['', '', 'twice', 'three times'][k]} "
                             "as large.")
            value, expr, ops = value * k, f"{_wrap(expr)} * {k}", ops + 1
        elif kind == "share":
            divisors = [d for d in range(2, 10) if value % d == 0 and value // d >= 1]
            if divisors:
                d = divisors[rng.integers(len(divisors))]
                sentences.append(f"{He} splits the {item} into {d} equal groups and keeps only one group.")
                value, expr, ops = value // d, f"{_wrap(expr)} / {d}", ops + 1
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), value, expr)


_FINAL = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")


def parse_number(text: str) -> float | None:
    """The number in an answer ("1,200", "$45", "45.0", "x = 12" -> 12); None when there is none."""
    found = re.findall(r"[-+]?\d[\d,]*\.?\d*|[-+]?\.\d+", str(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def load_gsm8k(path: str | Path) -> list[Problem]:
    """Problems of a GSM8K-format JSONL file: "question", and "answer" whose final line is "#### N"."""
    out = []
    for i, row in enumerate(read_jsonl(path)):
        m = _FINAL.search(str(row.get("answer", "")))
        if "question" not in row or m is None:
            raise ValueError(f"{path}: row {i} needs 'question' and an 'answer' ending in '#### N'")
        value = float(m.group(1).replace(",", ""))
        out.append(Problem(str(row["question"]), int(value) if value.is_integer() else value))  # type: ignore[arg-type]
    if not out:
        raise ValueError(f"{path}: no problems")
    return out
