"""The built-in model: deterministic from its seed, a complete Hugging Face folder, a tokenizer that keeps grid
symbols and digits apart, and a chat template that both engines use."""

from __future__ import annotations

import hashlib

import pytest

from app.default_model import PRESETS, build_default_model, resolve_model


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_model_in_two_fresh_folders(tmp_path):
    a = build_default_model(PRESETS["tiny"], tmp_path / "a")
    b = build_default_model(PRESETS["tiny"], tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name), name
    assert build_default_model(PRESETS["tiny"], tmp_path / "a") == a  # cached, not rebuilt


def test_folder_loads_with_transformers_and_tokenizes_symbol_by_symbol(default_model):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(default_model)
    assert config.model_type == "qwen2"
    tok = AutoTokenizer.from_pretrained(default_model)
    grid = "#_P_X#\n#O√S_#"
    pieces = tok.convert_ids_to_tokens(tok.encode(grid, add_special_tokens=False))
    assert len(pieces) == len(grid)  # one token per cell and newline
    assert tok.decode(tok.encode(grid, add_special_tokens=False)) == grid
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|assistant|>\n") and tok.eos_token == "<|end|>"
    assert tok.padding_side == "left"


def test_resolve_model_passes_other_names_through():
    assert resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    with pytest.raises(ValueError, match="preset"):
        resolve_model("default:huge")


def test_tokenizer_corpus_is_byte_identical():
    """The default model's cache key covers its sizes, not the corpus its tokenizer is trained on: the corpus (now
    played by the one episode runner) must not change, or a cached model would silently differ from a fresh one.
    The digest is that of the corpus before the runner existed (its own loop over the same envs)."""
    import json

    from app.default_model import tokenizer_corpus

    texts = tokenizer_corpus()
    assert len(texts) == 1828
    assert hashlib.sha256(json.dumps(texts).encode()).hexdigest() == (
        "fbfc1d1d9093254cbae80bc238c86b600cdd2aa6844ba327fa0e34a34d61e6c8")


def test_model_builds_from_inside_an_event_loop():
    """A Serve replica's constructor runs inside an event loop; building the default model there (a fresh machine
    whose cache lacks the preset) must not trip asyncio.run's "cannot be called from a running event loop"."""
    import asyncio

    from app.default_model import tokenizer_corpus

    async def inside_a_loop() -> int:
        return len(tokenizer_corpus())

    assert asyncio.run(inside_a_loop()) == 1828
