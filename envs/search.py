"""Search agents in the style of Search-R1: answer a question by searching a corpus over several turns.

Each turn the reply holds either ``<search>query</search>`` (the top-k passages become the next observation) or
``<answer>text</answer>`` (ends the episode). The reward comes only at the answer: 1.0 for an exact match with a
golden answer after SQuAD-style normalisation (lower case, no punctuation or articles), else 0, or the token F1 with
`reward="f1"`; `won` means an exact match. At most `max_steps` turns (4 by default).

Data: a built-in synthetic encyclopedia (`envs.data.encyclopedia`: invented people, cities, countries and companies
with 1-hop and 2-hop questions), or your own corpus (JSONL with "contents", or "title" and "text") and questions
(JSONL with "question" and "golden_answers" or "answer"). The retriever is local ("bm25", "dense"), any object with
``search(queries, k)``, or "serve": the training config's Retriever deployment, whose async client the env-group
actor hands the env (`set_retriever`; the episode runner's `astep` awaits it). A failed search is an observation
("search failed") and `info["env_error"]`, which the run counts: never a crash, never silent.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from typing import Any

from envs.base import Outcome, TextEnv, split_pool
from envs.data import clip, squash, to_charset
from envs.data.encyclopedia import Question, build_encyclopedia, load_qa
from envs.retrieval import Retriever, build_retriever, load_corpus
from envs.tools import find_tagged

TAGS = ("search", "answer")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, answers: tuple[str, ...] | list[str]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(a) for a in answers)


def token_f1(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """Best token-overlap F1 of `prediction` against the golden answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


@functools.lru_cache(maxsize=8)
def _local_retriever(kind: str, corpus: str, data_seed: int) -> Retriever:
    """One index per (backend, corpus) per process: every env built in a process shares it."""
    passages = build_encyclopedia(data_seed).passages if corpus == "builtin" else load_corpus(corpus)
    return build_retriever(kind, passages)


class SearchEnv(TextEnv):
    """Answer a question with a search engine (Search-R1 style replies: <search>, <answer>)."""

    name = "search"
    task_description = ("Search QA: answer the question. You may search a document collection; each search returns "
                        "the top passages. Give the answer as a short phrase.")
    example_action = "<search>who founded acme works</search>"
    max_steps = 4
    prompt_template = (
        "{task}\n"
        "{memory}"
        "Current state:\n{observation}\n"
        "Admissible actions: {actions}\n"
        "Reply with <search>your query</search> to search, or <answer>your answer</answer> to finish (an "
        "<action></action> wrapper around either is optional), e.g. {example}"
    )

    heldout_splits = {"test": {"split": "test"}}

    def __init__(self, retriever: str | Retriever = "bm25", corpus: str = "builtin", qa: str | None = None,
                 data_seed: int = 0, top_k: int = 3, reward: str = "em", max_steps: int | None = None,
                 max_passage_chars: int = 400, max_query_chars: int = 200, split: str = "train"):
        if reward not in ("em", "f1"):
            raise ValueError(f"reward must be 'em' or 'f1', got {reward!r}")
        if corpus != "builtin" and qa is None:
            raise ValueError("a custom corpus needs its questions too: pass qa='path/to/questions.jsonl'")
        if isinstance(retriever, str) and retriever not in ("bm25", "dense", "serve"):
            raise ValueError(f"retriever must be 'bm25', 'dense', 'serve' or an object with .search(queries, k); "
                             f"got {retriever!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        split_pool([], split)  # a bad split name fails here
        super().__init__(max_steps=max_steps, max_obs_chars=1024 + top_k * (max_passage_chars + 16))
        self.retriever_spec, self.corpus, self.qa, self.data_seed = retriever, corpus, qa, data_seed
        self.top_k, self.reward_kind, self.split = top_k, reward, split
        self.max_passage_chars, self.max_query_chars = max_passage_chars, max_query_chars
        self._retriever: Retriever | None = None if isinstance(retriever, str) else build_retriever(retriever, [])
        self._error: str | None = None  # this step's retriever failure, if any
        self._prefetched: tuple[list[str], str | None] | None = None  # astep's search: (results, error)
        self._questions: list[Question] | None = None
        self.question = Question("", ("",))
        self._query: str | None = None
        self._results: list[str] = []
        self._searches = 0

    # ---- data, loaded on first use so that building the env stays cheap -------------------------------------------
    @property
    def questions(self) -> list[Question]:
        if self._questions is None:
            pool = load_qa(self.qa) if self.qa else build_encyclopedia(self.data_seed).questions
            self._questions = split_pool(pool, self.split)  # "train" never sees a "test" question
        return self._questions

    @property
    def retriever(self) -> Retriever:
        if self._retriever is None:
            if self.retriever_spec == "serve":
                raise RuntimeError("retriever 'serve' needs the retriever deployment: add a `retriever:` section to "
                                   "the training (or agent) config")
            self._retriever = _local_retriever(str(self.retriever_spec), self.corpus, self.data_seed)
        return self._retriever

    def set_retriever(self, retriever: Any) -> None:
        """Use `retriever` (``search(queries, k)``, or ``async asearch(queries, k)`` for `astep`)."""
        self._retriever = retriever

    # ---- hooks ----------------------------------------------------------------------------------------------------
    def _new_episode(self, options: dict[str, Any] | None) -> None:
        self.question = self.questions[int(self.np_random.integers(len(self.questions)))]
        self._query, self._results, self._searches = None, [], 0

    def _observe(self) -> str:
        text = f"Question: {to_charset(self.question.question)}"
        if self._query is not None:
            docs = "\n".join(f"Doc {i}: {clip(to_charset(p), self.max_passage_chars)}"
                             for i, p in enumerate(self._results, 1)) or "(no results)"
            text += f'\nResults for "{self._query}":\n<information>\n{docs}\n</information>'
        return clip(text, self.observation_space.max_length)

    def admissible_actions(self) -> list[str]:
        return ["<search>...</search>", "<answer>...</answer>"]

    def match_action(self, reply: str) -> str | None:
        """The canonical action in a raw reply: the first <search> or <answer> tag, its text lower-cased and put on
        one line. An empty query or answer is invalid."""
        found = find_tagged(reply, TAGS)
        if found is None:
            return None
        tag, text = found
        text = squash(text).lower()
        if tag == "search":
            text = text[: self.max_query_chars].strip()
        if not re.search(r"[a-z0-9]", text):
            return None
        return f"<{tag}>{text}</{tag}>"

    def _apply(self, action: str) -> Outcome:
        tag, text = find_tagged(action, TAGS)  # type: ignore[misc]  # canonical, so always found
        if tag == "search":
            self._searches += 1
            self._query = text
            if self._prefetched is not None:  # astep searched already, without blocking the event loop
                (self._results, self._error), self._prefetched = self._prefetched, None
            else:
                try:
                    self._results = list(self.retriever.search([text], self.top_k)[0])[: self.top_k]
                except Exception as err:  # a failing retriever is an observation and a counted error, not a crash
                    self._fail(err)
            return Outcome(0.0)
        won = exact_match(text, self.question.answers)
        reward = 1.0 if won else (token_f1(text, self.question.answers) if self.reward_kind == "f1" else 0.0)
        return Outcome(reward, terminated=True, won=won, key_event=f"answered {text!r}")

    def _fail(self, err: BaseException) -> None:
        self._results = [f"search failed: {type(err).__name__}"]
        self._error = f"retriever: {type(err).__name__}: {err}"[:300]

    async def astep(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """`step`, with the search of an async retriever (the Serve deployment's client) awaited first."""
        action = self.match_action(reply)
        asearch = getattr(self._retriever, "asearch", None)
        if action is not None and action.startswith("<search>") and asearch is not None:
            query = find_tagged(action, TAGS)[1]  # type: ignore[index]
            try:
                self._prefetched = (list((await asearch([query], self.top_k))[0])[: self.top_k], None)
            except Exception as err:
                self._fail(err)
                self._prefetched = (self._results, self._error)
        return self.step(reply)

    def step(self, reply: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        searches = self._searches
        self._error = None
        obs, reward, terminated, truncated, info = super().step(reply)
        self._prefetched = None
        if self._error is not None:
            info["env_error"] = self._error
        if self._searches > searches:  # what SearchMemory shows of this turn
            info["query"], info["results"] = self._query, list(self._results)
        elif info["action"] is not None:
            info["query"] = None  # an answer: nothing for SearchMemory to keep
        return obs, reward, terminated, truncated, info

    def expert_action(self) -> str | None:
        """Search each hop of the question in turn (generated questions know their hops), then answer. Questions
        loaded from a file have no hops: search the question itself once."""
        hops = self.question.hops or (self.question.question,)
        if self._searches < len(hops) and self._steps < self.max_steps - 1:
            return f"<search>{squash(hops[self._searches]).lower()[: self.max_query_chars].strip()}</search>"
        return f"<answer>{squash(self.question.answers[0]).lower()}</answer>"
