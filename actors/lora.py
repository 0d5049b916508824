"""LoRA adapters (peft), in one place: how the Train job adds one to the policy, which tensors are the adapter and
under which names they travel and are saved (peft's own adapter format, which vLLM and transformers load), how a
checkpoint merges them into a plain HF folder, and which target modules a model has. No Ray.

With `policy.lora`, only the adapter is trained and sent to the replicas after each update (a few MB where the model
is GBs). The KL reference is the base model: the policy with its adapter switched off (`AdapterOff`), as LoRA
recipes elsewhere do, so no second model is held.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from actors.config import LoraConfig

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_ACTIVE = ".default"  # peft's name for the one adapter of a model; its saved format leaves it out
# vLLM sizes its LoRA kernels for one of these ranks (vllm.config.lora.MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def peft_config(spec: LoraConfig, base: str | None = None) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                          lora_dropout=spec.dropout, task_type="CAUSAL_LM", base_model_name_or_path=base)


def add_adapter(model: torch.nn.Module, spec: LoraConfig) -> torch.nn.Module:
    """The model with a fresh adapter (B = 0: the policy starts as the base); only the adapter is trainable."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(spec))


def decoder_layers(model: torch.nn.Module) -> Any:
    """The decoder layers of an HF causal LM, with or without an adapter around it (FSDP2 shards each)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


class AdapterOff:
    """The base model as the KL reference: a call runs the policy with its adapter switched off (no gradient is
    taken through it: the caller runs it under no_grad)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, **inputs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(**inputs)


def adapter_items(state: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The adapter's entries of a peft model's state dict, under the names of peft's saved format."""
    for name, value in state:
        if ".lora_A." in name or ".lora_B." in name:
            yield name.replace(_ACTIVE, ""), value


def write_adapter(folder: str | Path, tensors: Mapping[str, Any], spec: LoraConfig, base: str | None = None) -> Path:
    """An adapter folder (adapter_config.json + adapter_model.safetensors) that peft and vLLM load."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    peft_config(spec, base).save_pretrained(str(folder))
    save_file({k: torch.as_tensor(v).contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_FILE),
              metadata={"format": "pt"})
    return folder


def read_adapter(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An adapter folder's tensors and its peft config (as a dict: r, lora_alpha, target_modules, ...)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    return load_file(str(folder / ADAPTER_FILE)), json.loads((folder / ADAPTER_CONFIG).read_text())


def adapter_rank(folder: str | Path) -> int:
    return int(json.loads((Path(folder) / ADAPTER_CONFIG).read_text())["r"])


def vllm_rank(rank: int) -> int:
    """The smallest rank vLLM's kernels are built for that holds `rank`."""
    return next(r for r in VLLM_RANKS if r >= rank)


def merge(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scale: float
          ) -> dict[str, torch.Tensor]:
    """The base weights with the adapter merged in (W + scale * B A, in float32, back in W's dtype): a plain HF
    state dict that serves and evaluates like base + adapter."""

    merged = dict(base)
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        if target not in merged:
            raise KeyError(f"the adapter's {name} has no base weight {target}")
        w = merged[target]
        merged[target] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged


def target_candidates(model_path: str) -> list[str]:
    """The names (last part) of the model's linear layers inside its decoder layers: what `target_modules` may
    name. The model is built on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and ".layers." in name})


def check_targets(model_path: str, spec: LoraConfig) -> None:
    """A target module the model does not have fails here, naming the ones it has."""
    allowed = target_candidates(model_path)
    missing = [t for t in spec.target_modules if t not in allowed]
    if missing:
        raise ValueError(f"target_modules {missing} are not linear layers of {model_path}; allowed: {allowed}")
