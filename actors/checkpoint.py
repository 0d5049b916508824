"""The one place that knows a run folder's layout. Checkpoints are an HF folder (safetensors + config + tokenizer,
loadable by vLLM and transformers as it is) plus the Train job's sharded state and the controller's state, written
into a temporary folder and renamed into place: a checkpoint folder either exists whole or not at all.

    runs/<run>/
        reference/            the policy RL started from, when a warm start made it (the KL reference): an HF
                              folder written once and never rotated
        checkpoints/iter_000010/
            model/            config.json, generation_config.json, tokenizer files, model.safetensors, and
                              raygent_agent.json: the agent it is (env, memory, prompt, sampling; AgentCard).
                              A LoRA run's adapter is merged in: the folder serves and evaluates as it is
            adapter/          LoRA runs only: the adapter as peft saves it (adapter_config.json,
                              adapter_model.safetensors) and the agent card; it applies to state.json's base_model
            train_state/      model and AdamW state as trained, one shard file per Train rank plus DCP's metadata
                              (torch.distributed.checkpoint: no rank gathers the optimizer; another world size
                              reshards on load)
            state.json        layout version, iteration, weight version, seeds, the KL reference, base model, config

Layout versions: 1 (no `reference_model` in state.json: the reference was whatever model the run loaded), 2 (a full
`optimizer.pt` written by rank 0 in place of `train_state/`), 3 (sharded `train_state/`), 4 (`adapter/` and
`base_model` for LoRA runs). All four resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.storage import STORAGE_COMPLETE

if TYPE_CHECKING:
    import torch

    from actors.storage import Storage

LAYOUT_VERSION = 4
TRAIN_STATE = "train_state"
ADAPTER = "adapter"
CARD_FILE = "raygent_agent.json"
_NAME = re.compile(r"^iter_(\d{6})$")
logger = logging.getLogger("raygent")


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


def write_agent_card(folder: Path, card: Any) -> None:
    """The model folder's agent card (an `actors.config.AgentCard`), next to its weights."""
    (Path(folder) / CARD_FILE).write_text(card.model_dump_json(indent=2) + "\n")


def read_agent_card(folder: str | Path) -> Any:
    """The AgentCard of a model folder, or None for a folder without one (a hub model, a plain HF folder)."""
    from actors.config import AgentCard

    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return None
    return AgentCard.model_validate_json(path.read_text())


def load_model_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """An HF folder's weights (a checkpoint's model/, one file or sharded) as the trainer hands them to the
    replicas: every parameter, a tied head included
    (the file stores it once, as HF does; an engine reloading weights in place must get it again, or it keeps the
    head it had)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"  # a large HF folder is sharded
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    weights = {name: t for f in files for name, t in load_file(str(model_dir / f)).items()}
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def base_model_weights(model: str) -> dict[str, torch.Tensor]:
    """The weights of the model a run starts from: a local HF folder as `load_model_weights` reads it, or a hub id
    through transformers (its cache), with the head a tied model shares."""
    if Path(model).is_dir():
        return load_model_weights(model)
    import torch
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict())


def save_model(weights: Mapping[str, torch.Tensor | np.ndarray], template_dir: Path, out_dir: Path,
               card: Any = None) -> None:
    """An HF model folder: the template's config and tokenizer files, the weights (tensors in any dtype, or numpy
    arrays) and the agent card."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in template_dir.iterdir():
        shutil.copy2(f, out_dir / f.name)
    if card is not None:
        write_agent_card(out_dir, card)
    config = json.loads((template_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings")  # the head is the embedding: stored once, as HF does
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v.contiguous()
               for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    try:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    except SafetensorError as e:  # its I/O errors (a full disk) are not OSErrors: a refused write is one here
        raise OSError(f"writing {out_dir / 'model.safetensors'}: {e}") from e


async def save_checkpoint(run_dir: Path, iteration: int, weights: Mapping[str, Any], template_dir: Path,
                          state: dict[str, Any], keep: int,
                          save_train_state: Callable[[str], Awaitable[None]] | None = None, card: Any = None,
                          pinned: set[Path] | frozenset[Path] = frozenset(), adapter: Mapping[str, Any] | None = None,
                          lora: Any = None) -> Path:
    """Write checkpoint `iter_{iteration}` atomically; keep the newest `keep` and every `pinned` one (the checkpoint
    this run resumed from: its replicas and actors load their starting model from it, so it must outlive
    rotation). `weights` are the full model's (a LoRA run's merged ones); `adapter` (with its `lora` config) is
    written beside them. `save_train_state(path)` asks the training job to write its sharded state into that
    folder of the temporary checkpoint before the rename. Re-checkpointing an iteration swaps the folders: there is
    never a moment without a complete checkpoint of it on disk. A refused write (full or read-only disk) is an
    OSError."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-iter_{iteration:06d}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be read by other users and tools
    state = {"layout_version": LAYOUT_VERSION, **state}
    if state.get("reference_model"):
        state["reference_model"] = _relative_to(state["reference_model"], run_dir)
    try:
        save_model(weights, template_dir, tmp / "model", card)
        if adapter is not None:
            save_adapter(adapter, lora, tmp / ADAPTER, state.get("base_model"), card)
        if save_train_state is not None:
            await save_train_state(str(tmp / TRAIN_STATE))
        (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str))
        previous = None
        if final.exists():  # re-checkpointing the same iteration (e.g. /checkpoint then the scheduled one)
            previous = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, previous)
        os.replace(tmp, final)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    keep_paths = {p.resolve() for p in pinned}
    for old in list_checkpoints(run_dir)[:-keep]:
        if old.resolve() not in keep_paths:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_adapter(tensors: Mapping[str, Any], lora: Any, out_dir: Path, base_model: str | None = None,
                 card: Any = None) -> None:
    """A LoRA adapter folder (peft's format, `actors.lora.write_adapter`) with the agent card."""
    from safetensors import SafetensorError

    from actors.lora import write_adapter

    try:
        write_adapter(out_dir, tensors, lora, base_model)
    except SafetensorError as e:  # as in save_model: a full disk is a refused write
        raise OSError(f"writing {out_dir}: {e}") from e
    if card is not None:
        write_agent_card(out_dir, card)


def adapter_of(checkpoint: Path) -> Path | None:
    """A LoRA run's checkpoint's adapter folder (None for a full fine-tuning checkpoint)."""
    folder = Path(checkpoint) / ADAPTER
    return folder if (folder / "adapter_config.json").is_file() else None


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


def train_state_of(checkpoint: Path | None) -> dict[str, str | None]:
    """What a Train job resumes from besides the HF model: the sharded `train_state` folder (layout 3) or a
    layout-2 full `optimizer_state` file; neither for a start from scratch."""
    found = {"train_state": None, "optimizer_state": None}
    if checkpoint is not None:
        if (Path(checkpoint) / TRAIN_STATE / ".metadata").is_file():
            found["train_state"] = str(Path(checkpoint) / TRAIN_STATE)
        elif (Path(checkpoint) / "optimizer.pt").is_file():
            found["optimizer_state"] = str(Path(checkpoint) / "optimizer.pt")
    return found


def _relative_to(path: str, run_dir: Path) -> str:
    """A path inside the run folder is stored relative to it, so a run folder that moves keeps working."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path(run_dir).resolve()))
    except ValueError:
        return path


def save_reference(run_dir: Path, weights: Mapping[str, Any], template_dir: Path, card: Any = None) -> Path:
    """Write the run's KL reference (the policy RL starts from) once, atomically, outside the rotating checkpoints."""
    final = Path(run_dir) / "reference"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-reference-", dir=run_dir))
    tmp.chmod(0o755)
    try:
        save_model(weights, template_dir, tmp, card)
        if final.exists():  # a re-run warm start (resume: never) replaces it; the old one is not needed any more
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final




def mirror_checkpoint(run_dir: Path, checkpoint: Path, storage: Storage) -> None:
    """A checkpoint written in the run folder, copied to the run's folder in storage (`checkpoint.storage`): its
    files, then the KL reference (once per version of it) and the metrics so far, then a marker, last: a copy
    without the marker is never resumed from. Checkpoints the run folder no longer keeps go from storage too."""
    name = f"checkpoints/{checkpoint.name}"
    storage.delete(name)  # a copy of an earlier, interrupted attempt
    storage.upload(checkpoint, name)
    mirror_reference(run_dir, storage)
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file():
        storage.upload(metrics, "metrics.jsonl")
    # the marker's text tells this copy from an earlier one of the same iteration (nodes cache fetched folders by it)
    storage.write_text(f"{name}/{STORAGE_COMPLETE}", f"{checkpoint.name} {time.time_ns()}")
    kept = {p.name for p in list_checkpoints(run_dir)}
    for folder in storage.folders("checkpoints"):
        if _NAME.match(folder) and folder not in kept:
            storage.delete(f"checkpoints/{folder}")


def mirror_reference(run_dir: Path, storage: Storage) -> None:
    """The run's KL reference folder (written after a warm start), copied to storage once per version of it."""
    reference = Path(run_dir) / "reference"
    if reference.is_dir():
        stamp = str(reference.stat().st_mtime_ns)  # a warm start run again writes a new reference folder
        marker = f"reference/{STORAGE_COMPLETE}"
        if not storage.exists(marker) or storage.read_text(marker) != stamp:
            storage.delete("reference")
            storage.upload(reference, "reference")
            storage.write_text(marker, stamp)


def publish_start_model(model_dir: str | Path, storage: Storage) -> str:
    """A local model folder a run starts from, copied into the run's storage once per version of it (its files'
    names, sizes and mtimes): the URI every node fetches it from."""
    from actors.storage import folder_stamp

    rel = f"start_model/{folder_stamp(Path(model_dir))}"
    if not storage.exists(f"{rel}/{STORAGE_COMPLETE}"):
        storage.delete(rel)
        storage.upload(model_dir, rel)
        storage.write_text(f"{rel}/{STORAGE_COMPLETE}", rel)
    return storage.uri_of(rel)


def in_storage(folder: str, run_dir: Path, storage: Storage | None) -> str:
    """How a folder of the run folder (the reference, a checkpoint's model/ or train_state/) is handed to a process
    that may run on another node: its URI in storage, where `mirror_checkpoint` copied it. Anything else (a URI, a
    hub id, a folder outside the run folder) and every folder of a run without storage stay as they are."""
    if storage is None or not folder:
        return folder
    try:
        rel = Path(folder).resolve().relative_to(Path(run_dir).resolve())
    except ValueError:
        return folder
    return storage.uri_of(rel.as_posix())


def fetch_checkpoint(run_dir: Path, name: str, storage: Storage) -> Path:
    """Checkpoint `name` (iter_N) from the run's storage folder into the run folder, unless it is there already
    (with the KL reference and the metrics history where the run folder lacks them): its local folder."""
    run_dir = Path(run_dir)
    target = run_dir / "checkpoints" / name
    if not target.exists():
        if not storage.exists(f"checkpoints/{name}/{STORAGE_COMPLETE}"):
            raise FileNotFoundError(f"{name}: not in this node's run folder {run_dir} nor complete in {storage!r}")
        storage.download(f"checkpoints/{name}", target)
        (target / STORAGE_COMPLETE).unlink(missing_ok=True)
    if storage.exists(f"reference/{STORAGE_COMPLETE}") and not (run_dir / "reference").exists():
        storage.download("reference", run_dir / "reference")
        (run_dir / "reference" / STORAGE_COMPLETE).unlink(missing_ok=True)
    if storage.exists("metrics.jsonl") and not (run_dir / "metrics.jsonl").exists():
        storage.download("metrics.jsonl", run_dir / "metrics.jsonl")
    return target


def fetch_latest_checkpoint(run_dir: Path, storage: Storage) -> Path | None:
    """The newest complete checkpoint in the run's storage folder, fetched into the run folder, for a run resumed
    on a node that does not have it; None when storage holds none."""
    name = latest_in_storage(storage)
    return fetch_checkpoint(run_dir, name, storage) if name else None


def latest_in_storage(storage: Storage) -> str | None:
    """The name (iter_N) of the newest complete checkpoint in the run's storage folder, None if it holds none."""
    complete = [n for n in storage.folders("checkpoints")
                if _NAME.match(n) and storage.exists(f"checkpoints/{n}/{STORAGE_COMPLETE}")]
    return complete[-1] if complete else None


def reference_model_of(checkpoint: Path, state: dict[str, Any]) -> str:
    """The KL reference recorded in a checkpoint's state (relative paths are inside its run folder)."""
    checkpoint = Path(checkpoint)
    ref = state.get("reference_model")
    if not ref:
        logger.warning("%s has no reference_model in its state (layout version %s): the KL reference becomes the "
                       "resumed weights", checkpoint, state.get("layout_version", 1))
        return str(checkpoint / "model")
    path = Path(ref)
    if not path.is_absolute() and (checkpoint.parent.parent / path).exists():
        return str((checkpoint.parent.parent / path).resolve())
    return ref
