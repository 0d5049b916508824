"""The default policy, built here: a small Qwen2-architecture causal LM and its tokenizer, made deterministically
from a seed, because this machine has no model hub. Any Hugging Face folder, checkpoint or hub id loads through the
same path (`resolve_model`), so a GPU machine names e.g. Qwen/Qwen2.5-1.5B-Instruct instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from actors.builtin_models import PACKAGED_MODELS, build_packaged_model, save_model_folder
from actors.storage import check_on_this_node, fetch_folder, is_uri

DEFAULT_NAME = "default"

# Roles as single special tokens; a reply ends with <|end|>, which is the EOS the engines stop on.
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Each whitespace run, punctuation mark, underscore and digit is its own pre-token, so BPE never merges grid cells
# ("#_P_X#") or numbers into opaque chunks: a small model then reads positions and values one symbol at a time.
PRE_TOKENIZER_PATTERN = r"\s+|[^\w\s]|[_\d]"


@dataclass(frozen=True)
class DefaultModelSpec:
    """Sizes of the built-in model. The defaults give ~3.6M parameters; head_dim 64 suits vLLM's CPU kernels."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 2048

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


PRESETS: dict[str, DefaultModelSpec] = {
    "": DefaultModelSpec(),
    # Small enough for many optimizer steps a minute on 2 CPU cores (tests, the CPU learning demo).
    # Two heads of 32 (vLLM's CPU attention takes head sizes from 32): one head must both find the box offset and
    # the target offset in the prompt; two learn that from demonstrations in about half the steps (measured: 54% vs
    # 36% held-out success after 800 warm-start steps).
    "tiny": DefaultModelSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=192),
}


def cache_root() -> Path:
    return Path(os.environ.get("RAYGENT_CACHE", Path.home() / ".cache" / "raygent"))


# The envs whose prompts the default tokenizer is trained on. Fixed, not `envs.list_envs()`: adding an env must not
# change the default model. Text of other envs still tokenizes (byte-level BPE), in more, shorter pieces.
CORPUS_ENVS = ("sokoban", "treasure_hunt", "numberline", "ezpoints", "points24", "blackjack")


def tokenizer_corpus(seeds: int = 40) -> list[str]:
    """Prompts and replies of the core built-in envs, as the agent sees them (the episode runner, the paper's
    SimpleMemory k=2, the expert's action or else the first admissible one): the tokenizer learns this text. The
    default model's cache key does not cover it, so it must stay byte-identical (tests/test_default_model.py)."""
    import envs
    import memory
    from actors.episodes import play, run_sync, scripted_decider

    texts: list[str] = []

    def choose(turn) -> str:
        action = turn.env.expert_action() or turn.info["admissible_actions"][0]
        texts.append(turn.prompt_text)
        texts.append(f"<action>{action}</action>")
        return texts[-1]

    async def play_corpus() -> None:
        for name in CORPUS_ENVS:
            env = envs.make(name)
            for seed in range(seeds):
                await play(env, memory.make("simple", k=2), scripted_decider(choose), seed=seed)

    run_sync(play_corpus())
    return texts


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the env corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", bos_token=None, unk_token=None,
        padding_side="left", chat_template=CHAT_TEMPLATE, model_max_length=2048,
    )


def build_default_model(spec: DefaultModelSpec = DefaultModelSpec(), cache_dir: Path | None = None) -> Path:
    """Build (once) and return the folder of the default model for `spec`. Safe when several processes race:
    each builds in a private temp folder and the first rename wins."""
    target = (cache_dir or cache_root() / "models") / f"default-{spec.key()}"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return save_model_folder(target, model, tokenizer, "raygent_spec.json", asdict(spec))


def resolve_model(name: str, cache_dir: Path | None = None) -> str:
    """"default" or "default:PRESET" -> the built folder; a packaged pretrained model ("smollm2-135m",
    actors/builtin_models.py) -> its HF folder, built once; a local folder (a checkpoint's model/, a `raygent sft`
    output) -> its absolute path, so Ray workers with another working directory find it; a folder in storage (a
    URI) -> this node's cached copy of it (actors/storage.py); a hub id as is."""
    if name == DEFAULT_NAME or name.startswith(DEFAULT_NAME + ":"):
        preset = name.partition(":")[2]
        if preset not in PRESETS:
            allowed = sorted(DEFAULT_NAME + (":" + p if p else "") for p in PRESETS)
            raise ValueError(f"unknown default-model preset {preset!r}; allowed: {allowed}")
        return str(build_default_model(PRESETS[preset], cache_dir))
    if name in PACKAGED_MODELS:  # a pretrained model shipped in a Python package: its HF folder, built once
        return str(build_packaged_model(name, cache_dir or cache_root() / "models"))
    if is_uri(name):  # a folder in storage: this node's copy
        return str(fetch_folder(name))
    check_on_this_node(name)  # a path this node lacks is not a hub id
    local = Path(name).expanduser()
    return str(local.resolve()) if local.is_dir() else name
