"""Data for the text envs: generators that build catalogues, encyclopedias and word problems from a seed at run
time (nothing large is stored in the repository), loaders for the official files, and text helpers."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envs.base import CHARSET

_ALLOWED = frozenset(CHARSET)
_SPACES = re.compile(r"[ \t\r\x0b\x0c]+")


def to_charset(text: str) -> str:
    """`text` folded into the observation charset: accents stripped (NFKD), tabs made spaces, anything else dropped."""
    text = unicodedata.normalize("NFKD", str(text)).replace("\t", " ").replace("\r", "")
    return "".join(ch for ch in text if ch in _ALLOWED)


def squash(text: str) -> str:
    """One line, single spaces, stripped: the canonical form of a query or a clicked label."""
    return _SPACES.sub(" ", to_charset(text).replace("\n", " ")).strip()


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, marked with "..." when cut."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSON-lines file (blank lines skipped); a bad line raises ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
            yield row
