"""The update (actors/learner.py) on its own, without Ray: every loss_agg_mode is the loss over the whole minibatch
whatever the micro-batch size and the number of FSDP2 ranks; a positive advantage raises a reply's probability;
off-policy correction, bf16, activation checkpointing and the learning-rate schedule do what they say."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from actors.config import OptimConfig, TrainConfig
from actors.learner import (
    correction_weights,
    importance_weights,
    lr_at,
    rl_step,
    token_logprobs,
)
from algorithms.losses import LOSS_AGG_MODES
from tests.update_helpers import (
    build_model,
    free_port,
    fsdp_rank,
    gradient_of,
    load_model,
    make_conversation_rows,
    make_rows,
    rel_error,
    take,
)

TOLERANCE = 1e-5  # relative norm error of two fp32 gradients of one loss (elementwise checks fail on tiny entries)
N_ROWS = 13


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("update")
    return build_model(root / "policy", seed=0), build_model(root / "reference", seed=1)


def _case(mode: str, **extra):
    # Rollout log-probs that differ from the model's: ratios away from 1, so clipping, approx KL and the whole
    # surrogate take part; KL to a different reference and an entropy bonus on.
    return {"loss_agg_mode": mode, "kl_coef": 0.1, "entropy_coef": 0.01, "old_logprobs": "rollout",
            "clip_low": 0.1, "clip_high": 0.1, **extra}


@pytest.mark.parametrize("kind", ["steps", "conversations"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_does_not_depend_on_micro_batch_size(folders, mode, kind):
    policy, reference = folders
    model, ref = load_model(policy), load_model(reference).eval()
    rows = (make_rows if kind == "steps" else make_conversation_rows)(N_ROWS, seed=1)
    whole, metrics = gradient_of(model, ref, rows, {**_case(mode), "micro_batch_size": N_ROWS})
    assert metrics["clip_frac"] > 0 and metrics["kl"] > 0
    for size in (1, 3):
        grad, m = gradient_of(model, ref, rows, {**_case(mode), "micro_batch_size": size})
        assert rel_error(grad, whole) <= TOLERANCE, (mode, size)
        for key in ("loss", "approx_kl", "clip_frac", "kl", "entropy"):
            assert m[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-9), (mode, size, key)


@pytest.mark.slow
def test_two_fsdp2_ranks_compute_the_single_process_gradient(folders, tmp_path):
    """7 rows on rank 0 and 6 on rank 1 (micro-batches of 2: 4 against 3, so rank 1 runs a zero-weight one): the
    sharded update's gradient, loss and token-weighted metrics are those of one process over all 13 rows, with
    conversation rows (env tokens masked out) among them."""
    policy, reference = folders
    rows = make_conversation_rows(N_ROWS, seed=2)  # masked multi-turn rows and one-turn rows (step rows) mixed
    splits = [list(range(7)), list(range(7, N_ROWS))]
    cases = [{"optim": {**_case(m), "micro_batch_size": 2}} for m in LOSS_AGG_MODES]
    cases.append({"optim": {"loss_agg_mode": "token-mean", "kl_coef": 0.1, "old_logprobs": "recompute",
                            "rollout_correction": "tis", "micro_batch_size": 2}})
    cases.append({"optim": {**_case("token-mean"), "micro_batch_size": 2}, "mixed_precision": "bf16"})
    out = tmp_path / "ranks.pt"
    mp.start_processes(fsdp_rank, args=(2, free_port(), str(policy), str(reference), rows, splits, cases,
                                        str(out)), nprocs=2, start_method="spawn")
    sharded = torch.load(out, weights_only=False)

    model, ref = load_model(policy), load_model(reference).eval()
    for case, got in zip(cases, sharded, strict=True):
        want, metrics = gradient_of(model, ref, rows, {**case["optim"], "micro_batch_size": N_ROWS})
        err = rel_error(got["grad"], want)
        if case.get("mixed_precision") == "bf16":  # bf16 compute: close to the fp32 gradient, but not it
            assert 1e-6 < err < 5e-2, err
            continue
        assert err <= TOLERANCE, (case, err)
        for key in ("loss", "pg_loss", "approx_kl", "clip_frac", "ratio_mean", "kl", "entropy",
                    "rollout_trainer_logprob_gap"):
            if key in metrics:
                assert got["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-9), (case, key)
        assert got["metrics"]["rows"] == N_ROWS


def _reply_logprobs(model, prompt, replies):
    from actors.learner import collate, reply_values

    batch = collate([prompt] * len(replies), replies, pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    return [float(v.sum()) for v in reply_values(logp, batch["response_mask"])]


@pytest.mark.parametrize("ratio_mode", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_bandit_positive_advantage_raises_its_reply(folders, ratio_mode, kl_coef):
    """One prompt, two replies with different first tokens, advantage +1 and -1: a few updates raise the first
    reply's log-prob and lower the second's, for PPO-clip and the GSPO ratio, with and without KL."""
    policy, _ = folders
    model = load_model(policy)
    ref = load_model(policy).eval() if kl_coef else None
    prompt, good, bad = [5, 9, 13, 7], [20, 21, 22], [30, 21, 22]
    before = _reply_logprobs(model, prompt, [good, bad])
    optim = OptimConfig(lr=1e-2, minibatch_size=2, micro_batch_size=2, ratio_mode=ratio_mode, kl_coef=kl_coef,
                        old_logprobs="recompute", loss_agg_mode="seq-mean-token-mean")
    opt = torch.optim.Adam(model.parameters(), lr=optim.lr)
    rng = np.random.default_rng(0)
    for _ in range(5):
        rows = {"prompt_ids": [prompt, prompt], "response_ids": [good, bad],
                "rollout_logprobs": [[0.0] * 3, [0.0] * 3], "advantage": [1.0, -1.0]}
        rl_step(model, opt, rows, optim, lr=optim.lr, norm_length=3, pad_id=0, device="cpu", rng=rng,
                ref_model=ref)
    after = _reply_logprobs(model, prompt, [good, bad])
    assert after[0] > before[0] + 0.1, (before, after)
    assert after[1] < before[1] - 0.1, (before, after)


def test_rollout_correction_weights():
    trainer = [np.log([0.5, 0.5, 0.5])]
    rollout = [np.log([0.5, 0.1, 0.9])]  # w = 1, 5, 0.56
    raw = importance_weights(trainer, rollout)
    np.testing.assert_allclose(raw[0], [1.0, 5.0, 0.5 / 0.9], rtol=1e-6)
    tis = correction_weights(raw, OptimConfig(rollout_correction="tis", rollout_is_cap=2.0))
    np.testing.assert_allclose(tis[0], [1.0, 2.0, 0.5 / 0.9], rtol=1e-6)
    mask = correction_weights(raw, OptimConfig(rollout_correction="mask", rollout_is_cap=2.0, rollout_is_floor=0.6))
    np.testing.assert_array_equal(mask[0], [1.0, 0.0, 0.0])
    assert correction_weights(raw, OptimConfig())[0].tolist() == [1.0, 1.0, 1.0]


def test_tis_changes_the_gradient_and_mask_drops_tokens(folders):
    policy, _ = folders
    model = load_model(policy)
    rows = make_rows(N_ROWS, seed=3, perturb=1.5)
    plain, _ = gradient_of(model, None, rows, {"old_logprobs": "recompute"})
    tis, m_tis = gradient_of(model, None, rows, {"old_logprobs": "recompute", "rollout_correction": "tis"})
    masked, m_mask = gradient_of(model, None, rows, {"old_logprobs": "recompute", "rollout_correction": "mask"})
    assert rel_error(tis, plain) > 1e-3 and rel_error(masked, plain) > 1e-3
    assert m_tis["rollout_is_capped_frac"] > 0 and m_mask["rollout_is_outside_frac"] > 0
    assert m_mask["tokens"] < m_tis["tokens"]  # dropped tokens are out of the loss and its denominator
    assert m_tis["rollout_trainer_logprob_gap"] > 0.5  # the engine's log-probs were perturbed by 1.5


def test_tis_needs_the_trainers_own_logprobs():
    with pytest.raises(ValueError, match="old_logprobs: recompute"):
        OptimConfig(rollout_correction="tis", old_logprobs="rollout")
    with pytest.raises(ValueError, match="args.optim"):
        from actors.config import load_train_config

        load_train_config({"optim": {"rollout_correction": "mask", "old_logprobs": "rollout"}})


def test_gap_is_logged_under_rollout_logprobs(folders):
    policy, _ = folders
    model = load_model(policy)
    rows = make_rows(N_ROWS, seed=4, perturb=0.2)
    _, metrics = gradient_of(model, None, rows, {"old_logprobs": "rollout"})
    _, recomputed = gradient_of(model, None, rows, {"old_logprobs": "recompute"})
    assert metrics["rollout_trainer_logprob_gap"] == pytest.approx(recomputed["rollout_trainer_logprob_gap"], rel=1e-5)
    assert metrics["rollout_trainer_logprob_gap"] > 0.05


def test_bf16_autocast_computes_in_bf16(folders):
    policy, _ = folders
    model = load_model(policy)
    rows = make_rows(N_ROWS, seed=5)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    fp32, _ = gradient_of(model, None, rows, _case("token-mean", kl_coef=0.0))
    bf16, _ = gradient_of(model, None, rows, _case("token-mean", kl_coef=0.0), autocast_dtype=torch.bfloat16)
    hook.remove()
    assert seen[0] == torch.float32 and torch.bfloat16 in seen
    assert 1e-6 < rel_error(bf16, fp32) < 5e-2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 master weights


def test_activation_checkpointing_keeps_the_gradient(folders):
    policy, _ = folders
    model = load_model(policy).train()
    rows = make_rows(N_ROWS, seed=6)
    plain, _ = gradient_of(model, None, rows, _case("token-mean", kl_coef=0.0))
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, _ = gradient_of(model, None, rows, _case("token-mean", kl_coef=0.0))
    assert model.is_gradient_checkpointing
    assert rel_error(checkpointed, plain) <= TOLERANCE


def test_entropy_is_a_metric_without_autograd_unless_it_is_in_the_loss(folders):
    from actors.learner import collate

    model = load_model(folders[0])
    batch = collate([[3, 4, 5]], [[6, 7]], pad_id=0)
    logp, entropy = token_logprobs(model, batch, with_entropy=True)
    assert logp.requires_grad and not entropy.requires_grad
    _, entropy = token_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad


def test_lr_schedules():
    lr = 1e-3
    constant = OptimConfig(lr=lr, lr_warmup_iterations=2)
    assert [lr_at(constant, i, 10) for i in range(4)] == pytest.approx([lr / 2, lr, lr, lr])
    linear = OptimConfig(lr=lr, lr_schedule="linear", lr_min_ratio=0.1)
    assert lr_at(linear, 0, 11) == pytest.approx(lr)
    assert lr_at(linear, 5, 11) == pytest.approx(lr * (0.1 + 0.9 * 0.5))
    assert lr_at(linear, 10, 11) == pytest.approx(lr * 0.1)
    cosine = OptimConfig(lr=lr, lr_schedule="cosine", lr_warmup_iterations=1)
    assert lr_at(cosine, 0, 12) == pytest.approx(lr)  # the warmup's end
    assert lr_at(cosine, 1, 12) == pytest.approx(lr)  # decay starts
    assert lr_at(cosine, 6, 12) == pytest.approx(lr * 0.5)  # half way from iteration 1 to 11
    assert lr_at(cosine, 11, 12) == pytest.approx(0.0, abs=1e-12)


def test_dr_grpo_divides_by_the_configured_length():
    cfg = TrainConfig.model_validate({"rollout": {"max_tokens": 24}})
    assert cfg.loss_norm_length == 24
    assert TrainConfig.model_validate({"optim": {"loss_norm_length": 7}}).loss_norm_length == 7


def test_rows_that_do_not_divide_by_the_minibatch_all_train(folders):
    """13 rows, minibatches of 5: three optimizer steps of 5, 4 and 4 rows, no row left out."""
    model = load_model(folders[0])
    rows = make_rows(N_ROWS, seed=7)
    optim = OptimConfig(minibatch_size=5, micro_batch_size=2)
    metrics = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0), rows, optim, lr=0.0, norm_length=8,
                      pad_id=0, device="cpu", rng=np.random.default_rng(0))
    assert metrics["optimizer_steps"] == 3 and metrics["rows"] == N_ROWS
    assert metrics["tokens"] == sum(len(r) for r in rows["response_ids"])
    assert take(rows, [0])["prompt_ids"] == [rows["prompt_ids"][0]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_of_a_conversation_take_no_part(folders, mode):
    """The env's and tools' tokens between a conversation's turns (mask 0) change nothing when their rollout log-probs
    and advantages change (loss, gradient, every statistic, the token count); unmasking one of them does."""
    policy, reference = folders
    model, ref = load_model(policy), load_model(reference).eval()
    optim = {**_case(mode), "micro_batch_size": 4, "old_logprobs": "recompute", "rollout_correction": "tis"}
    rows = make_conversation_rows(N_ROWS, seed=3)
    grad, metrics = gradient_of(model, ref, rows, optim)
    rng = np.random.default_rng(0)
    noisy = {**rows, "rollout_logprobs": [[x if m else float(rng.normal(-3, 2)) for x, m in zip(lp, mask, strict=True)]
                                          for lp, mask in zip(rows["rollout_logprobs"], rows["loss_mask"], strict=True)],
             "token_advantages": [[a if m else float(rng.normal(0, 5)) for a, m in zip(adv, mask, strict=True)]
                                  for adv, mask in zip(rows["token_advantages"], rows["loss_mask"], strict=True)]}
    grad2, metrics2 = gradient_of(model, ref, noisy, optim)
    assert rel_error(grad2, grad) <= TOLERANCE
    for key in ("loss", "approx_kl", "clip_frac", "kl", "entropy", "tokens", "rollout_trainer_logprob_gap",
                "rollout_is_weight_mean"):
        assert metrics2[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-12), key
    assert metrics["tokens"] == sum(sum(m) for m in rows["loss_mask"])
    unmasked = {**noisy, "loss_mask": [list(m) for m in noisy["loss_mask"]]}
    unmasked["loss_mask"][0][unmasked["loss_mask"][0].index(0)] = 1
    grad3, metrics3 = gradient_of(model, ref, unmasked, optim)
    assert rel_error(grad3, grad) > 1e-3 and metrics3["tokens"] == metrics["tokens"] + 1
