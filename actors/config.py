"""The configuration schemas, in one module that imports no Serve: the training run (`TrainConfig`), the policy
replicas (`PolicyConfig`) and per-request sampling (`SamplingConfig`). The Serve apps, the controller, the Train
workers and the CLI all read them from here.

`serve run serve_configs/train.yaml` hands the application's `args:` to `TrainConfig.model_validate`; a wrong field
fails there with the field's path and what is allowed (`format_config_error`), before any actor starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import envs
import memory
from algorithms import ESTIMATORS
from algorithms.losses import KL_KINDS, LOSS_AGG_MODES, RATIO_MODES


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


EngineName = Literal["auto", "vllm", "hf"]


class SamplingConfig(BaseModel):
    """Per-request sampling settings (OpenAI-style names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(64, ge=1)
    stop: tuple[str, ...] = ()
    seed: int | None = None


class PolicyConfig(_Section):
    """What one policy replica loads and how it batches. Sizes are per replica."""

    model: str = Field("default", description='"default", "default:tiny", an HF folder, a checkpoint or a hub id')
    engine: EngineName = "auto"
    dtype: str = "float32"
    max_model_len: int = Field(1024, ge=16)
    kv_cache_bytes: int = Field(256 * 2**20, ge=16 * 2**20, description="vLLM KV cache on CPU")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_batch_size: int = Field(256, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0.0)
    seed: int = 0


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

    @model_validator(mode="after")
    def _enough_groups(self) -> RolloutConfig:
        if self.num_env_actors > self.n_groups:
            raise ValueError(f"num_env_actors ({self.num_env_actors}) must be <= n_groups ({self.n_groups})")
        return self


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
    use_gpu: bool = False
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: compute in bfloat16 with float32 master weights and float32 gradient reduction "
                            "(FSDP2 MixedPrecisionPolicy; autocast without FSDP)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                                              "backward pass: less memory, ~30% more compute")

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
    n_envs: int = Field(64, ge=1, description="held-out seeds, one episode each")
    temperature: float = Field(0.0, ge=0.0)
    baseline_envs: int | None = Field(
        None, ge=0, description="held-out seeds (the first of the validation seeds) for the untrained policy's "
                                "baseline before any training; None = n_envs, 0 = skip")


class CheckpointConfig(_Section):
    every: int = Field(10, ge=0, description="iterations between checkpoints (0 = only at the end)")
    keep: int = Field(3, ge=1)
    resume: str = Field("auto", description='"auto" (latest in the run folder), "never", or a checkpoint folder')


class LoggingConfig(_Section):
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
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _rollout_logprobs_are_the_policy(self) -> TrainConfig:
        # The trainer's log-probs are of the untempered policy; the engine's equal them only at T=1 with no top-p cut.
        if self.optim.old_logprobs == "rollout" and (self.rollout.temperature != 1.0 or self.rollout.top_p != 1.0):
            raise ValueError("optim.old_logprobs 'rollout' needs rollout.temperature 1.0 and rollout.top_p 1.0 "
                             "(the engine's log-probs are then the policy's); otherwise use 'recompute'")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).resolve() / self.run_name

    @property
    def loss_norm_length(self) -> int:
        """Dr. GRPO's constant: the configured maximum reply length unless set."""
        return self.optim.loss_norm_length or self.rollout.max_tokens

    @property
    def env_kwargs(self) -> dict[str, Any]:
        return {**self.env.kwargs, **({"max_steps": self.max_steps} if self.max_steps else {})}


def format_config_error(e: ValidationError, prefix: str = "args") -> str:
    """One line per problem: the field's dotted path and what is wrong or allowed."""
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in (prefix, *err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"  {path}: {msg}")
    return "invalid training config:\n" + "\n".join(lines)


def load_train_config(args: dict[str, Any] | None) -> TrainConfig:
    try:
        return TrainConfig.model_validate(args or {})
    except ValidationError as e:
        raise ValueError(format_config_error(e)) from None
