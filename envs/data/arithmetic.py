"""Multi-step arithmetic word problems in the manner of GSM8K (2-4 operations, whole-number answers), generated from
a seed, each with the expression that solves it; the loader of task files (GSM8K rows, or verl's task rows: chat
`prompt`, `reward_model.ground_truth`; JSONL or Parquet, local or a storage URI); and the writer of the generated set
as verl task rows (`python -m envs.data.arithmetic tasks.parquet --n 1000 --split train`)."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    tools_kwargs: str = ""  # a task row's per-sample tool arguments (verl's extra_info.tools_kwargs), as JSON
    agent_name: str = ""  # the conversation loop the row names (verl's agent_name column); "" for none
    messages: str = ""  # a task row's own chat `prompt` messages, as JSON; "" for generated and GSM8K problems


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


GSM8K_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")


def parse_number(text: str) -> float | None:
    """The number in an answer ("1,200", "$45", "45.0", "x = 12" -> 12); None when there is none."""
    found = re.findall(r"[-+]?\d[\d,]*\.?\d*|[-+]?\.\d+", str(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a task file: JSON lines, or Parquet (`.parquet`), at a local path or a storage URI (s3://,
    gs://, ... through pyarrow.fs)."""
    import pyarrow.fs
    import pyarrow.parquet as pq

    text = str(path)
    fs, where = pyarrow.fs.FileSystem.from_uri(text) if "://" in text else (pyarrow.fs.LocalFileSystem(),
                                                                           str(Path(text).resolve()))
    if text.endswith(".parquet"):
        return pq.read_table(where, filesystem=fs).to_pylist()
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        return list(read_jsonl(where))
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as tmp:
        with fs.open_input_stream(where) as src:
            tmp.write(src.read())
        tmp.flush()
        return list(read_jsonl(tmp.name))


def _number(value: Any) -> int | float:
    value = float(str(value).replace(",", ""))
    return int(value) if value.is_integer() else value


def _problem(row: dict[str, Any], where: str) -> Problem:
    """A problem from a GSM8K row ("question", "answer" ending in "#### N") or a verl task row ("prompt" chat
    messages, "reward_model": {"ground_truth": N}, optional "extra_info": {"question", "expression"})."""
    if "prompt" in row and isinstance(row.get("reward_model"), dict):
        extra = row.get("extra_info") or {}
        users = [m for m in row["prompt"] if m.get("role") == "user"]
        question = extra.get("question") or (users[-1]["content"] if users else None)
        truth = row["reward_model"].get("ground_truth")
        if not question or truth is None or parse_number(str(truth)) is None:
            raise ValueError(f"{where}: a task row needs a user message in 'prompt' and a numeric "
                             "reward_model.ground_truth")
        kwargs = extra.get("tools_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where}: extra_info.tools_kwargs must be an object of {{tool name: {{create_kwargs, "
                             "execute_kwargs}}")
        messages = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in row["prompt"]]
        return Problem(str(question), _number(parse_number(str(truth))), str(extra.get("expression") or ""),
                       json.dumps(kwargs, sort_keys=True) if kwargs else "", str(row.get("agent_name") or ""),
                       json.dumps(messages))
    m = GSM8K_ANSWER.search(str(row.get("answer", "")))
    if "question" not in row or m is None:
        raise ValueError(f"{where} needs 'question' and an 'answer' ending in '#### N' (GSM8K), or 'prompt' and "
                         "'reward_model' (a verl task row)")
    return Problem(str(row["question"]), _number(m.group(1)))  # type: ignore[arg-type]


def load_problems(path: str | Path) -> list[Problem]:
    """The problems of a task file (`read_rows`), GSM8K rows or verl task rows."""
    out = [_problem(row, f"{path}: row {i}") for i, row in enumerate(read_rows(path))]
    if not out:
        raise ValueError(f"{path}: no problems")
    return out


def task_row(problem: Problem, index: int, split: str) -> dict[str, Any]:
    """A problem as a verl task row (GSM8K multi-turn layout): the chat prompt, the reward's ground truth, and
    extra_info with the question, the solving expression (the expert's calculator call), the split and the
    per-sample tool arguments (verl's GSM8K reward tool, `calc_gsm8k_reward`, is given the ground truth, as verl's
    own GSM8K multi-turn rows give it)."""
    kwargs = json.loads(problem.tools_kwargs) if problem.tools_kwargs else {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": str(problem.answer)}}}
    return {"data_source": "raygent/arithmetic", **({"agent_name": problem.agent_name} if problem.agent_name else {}),
            "prompt": [{"role": "user", "content": problem.question}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
            "extra_info": {"split": split, "index": index, "question": problem.question,
                           "expression": problem.expression, "tools_kwargs": kwargs}}


def write_tasks(path: str | Path, n: int, split: str = "train", seed: int = 0) -> Path:
    """`n` generated problems of `split` as a task file (JSONL, or Parquet for a .parquet path). The splits never
    share a seed: train draws problems from even seeds, test from odd ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = 0 if split == "train" else 1
    rows = [task_row(generate_problem(np.random.default_rng([seed, first + 2 * i])), i, split) for i in range(n)]
    path = Path(path)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write generated arithmetic problems as a verl-format task file")
    parser.add_argument("path", help="out.jsonl or out.parquet")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--split", choices=["train", "test"], default="train")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(write_tasks(a.path, a.n, a.split, a.seed))
