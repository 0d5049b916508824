"""Checkpoints: an HF folder (safetensors + config + tokenizer, loadable by vLLM and transformers as it is) plus the
optimizer state and the controller's state, written into a temporary folder and renamed into place: a checkpoint
folder either exists whole or not at all.

    runs/<run>/checkpoints/iter_000010/
        model/            config.json, generation_config.json, tokenizer files, model.safetensors
        optimizer.pt      full (unsharded) AdamW state
        state.json        iteration, weight version, seeds, config
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

_NAME = re.compile(r"^iter_(\d{6})$")


def write_model_template(model_path: str, template_dir: Path) -> Path:
    """Everything of an HF folder but the weights (config, generation config, tokenizer), saved once per run."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if (template_dir / "config.json").exists():
        return template_dir
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-template-", dir=template_dir.parent))
    AutoConfig.from_pretrained(model_path).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(tmp)
    except OSError:  # models without a generation_config.json
        pass
    os.replace(tmp, template_dir)
    return template_dir


def save_model(weights: dict[str, np.ndarray], template_dir: Path, out_dir: Path) -> None:
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in template_dir.iterdir():
        shutil.copy2(f, out_dir / f.name)
    config = json.loads((template_dir / "config.json").read_text())
    if config.get("tie_word_embeddings"):  # the head is the embedding: stored once, as HF does
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})


async def save_checkpoint(run_dir: Path, iteration: int, weights: dict[str, np.ndarray], template_dir: Path,
                          state: dict[str, Any], keep: int,
                          save_optimizer: Callable[[str], Awaitable[None]] | None = None) -> Path:
    """Write checkpoint `iter_{iteration}` atomically; keep the newest `keep`. `save_optimizer(path)` asks the
    training job to write its optimizer state into the temporary folder before the rename."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-iter_{iteration:06d}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be read by other users and tools
    try:
        save_model(weights, template_dir, tmp / "model")
        if save_optimizer is not None:
            await save_optimizer(str(tmp / "optimizer.pt"))
        (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str))
        if final.exists():  # re-checkpointing the same iteration (e.g. /checkpoint then the scheduled one)
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written ones are temp folders and never match)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "state.json").read_text())
