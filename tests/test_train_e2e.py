"""End to end, as a user runs it: `serve run serve_configs/test_tiny.yaml` as a subprocess (on the session's Ray
cluster), polled over HTTP until done. One run's whole life in stages (kills, checkpoints here and in storage,
serving, resumes); then the runs that need a config of their own, each as short as its assertion allows: async
rollout under its staleness bound, replicas that fit no node, a full checkpoint disk, LoRA, and the built-in
pretrained model's lifecycle. These run last (conftest): `serve run` shuts Serve down when it exits."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import pytest
import yaml

from actors.checkpoint import LAYOUT_VERSION
from actors.metrics import prometheus_name
from tests.conftest import REPO, scrape_metrics
from tests.serve_helpers import ServeRun, get_history, get_status, training_config, wait_for

pytestmark = pytest.mark.slow


def write_config(tmp_path: Path, port: int, iterations: int, name: str = "config.yaml", **args) -> Path:
    return training_config(REPO / "serve_configs" / "test_tiny.yaml", tmp_path / name, port, tmp_path / "runs",
                           iterations=iterations, **args)


# The main end-to-end test sends its weights over a gloo weight group (`weight_sync.backend`, the CPU twin of
# nccl), so every fault below also hits the collective path: the group re-formed after a replica, a Train worker
# and the controller are killed, a new replica synced from a copy the Train job packs, checkpoints written from
# one. The other runs of this module keep the default object store.
GLOO = {"weight_sync": {"backend": "gloo", "timeout_s": 20}}
# The real model's engine vs trainer log-prob gap (float32; measured in test_real_model.py's engines test).
REAL_MODEL_LOGPROB_GAP = 1e-3


def pids_of(title: str) -> list[int]:
    """Worker processes whose Ray process title starts with `title` (`ray::EnvGroupActor`, `ray::RayTrainWorker`,
    `ray::ServeReplica:train:Policy`, `ray::Controller`); the session cluster runs without the dashboard, so the
    state API is not there to ask."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith(title):
            pids.append(proc.pid)
    return pids


def env_actor_pids() -> list[int]:
    return pids_of("ray::EnvGroupActor")


def kill_one(title: str) -> int:
    pid = pids_of(title)[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_for_phase(url: str, phases: tuple[str, ...], run: ServeRun, timeout: float, what: str) -> dict:
    """The run's status once its phase is one of `phases` or the run is done (polled often: a rollout of the tiny
    config lasts about a second)."""
    def reached() -> dict | None:
        status = get_status(url)
        return status if status["phase"] in phases or status["done"] else None

    return wait_for(reached, timeout, what, run, interval=0.2)


def trained_records(history: list[dict]) -> list[dict]:
    return [r for r in history if r.get("phase") == "train"]


def read_history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def kept_checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("iter_"))


@pytest.mark.timeout(900)
def test_a_run_lives_through_kills_checkpoints_serving_and_resumes(ray_cluster, serve_url, tmp_path,
                                                                         s3_bucket):
    """One run's whole life, as a user drives it with `serve run`, on the gloo weight group (the CPU twin of nccl:
    every fault below also hits the collective path) with every checkpoint mirrored to S3-compatible storage and only
    the newest kept (`keep: 1`, pinned ones aside). Each stage asserts what it showed:

    1. train 4 iterations (warm start first) while an env-group actor, a Policy replica and a Train worker are
       killed; the checkpoint's layout here and in storage; the gauges on Ray's metrics agent; the agent endpoint
       serves the checkpoint;
    2. resume to 7: an env-group actor killed once the checkpoint the run resumed from is older than the newest (a
       restart must still find the model folder it loads: pinned), then the controller killed (the ingress's
       health check starts it again and it resumes from the latest checkpoint); the KL goes on from the same
       reference.
    A resume from storage into an empty run folder (a new node or pod) is a stage of test_two_nodes.py.
    """
    from ray import serve

    from actors.checkpoint import STORAGE_COMPLETE
    from actors.storage import Storage
    from app.agent import build_agent_app

    # The cluster has one Serve instance whose HTTP port is fixed when it starts: every run uses the session's port,
    # so the configs agree with the running instance (or with the one `serve run` starts after the last exits).
    address = ray_cluster.get_runtime_context().gcs_address
    url = serve_url
    port = int(url.rsplit(":", 1)[1])
    run_dir = tmp_path / "runs" / "e2e-tiny"
    stored = Storage(s3_bucket.format(key="runs/e2e-tiny"))

    def config(iterations: int, name: str) -> Path:
        return write_config(tmp_path, port, iterations=iterations, name=name, **GLOO,
                            checkpoint={"every": 1, "keep": 1, "resume": "auto",
                                        "storage": s3_bucket.format(key="runs")})

    # ---- 1. train, with an env-group actor, a replica and a Train worker killed ------------------------------
    serve.delete("train")  # an earlier test's run: the first status must come from this one
    run = ServeRun(config(4, "stage1.yaml"), tmp_path / "stage1.log", address)
    try:
        # An env-group actor killed while a rollout is in flight; again at the next one if that rollout had
        # already ended (its iteration's record says whether its groups were redone or dropped).
        for _ in range(4):
            status = wait_for_phase(url, ("rollout",), run, 600, "a rollout")
            if status["done"]:
                break
            os.kill(env_actor_pids()[0], signal.SIGKILL)
            it = status["iteration"]
            wait_for(lambda it=it: get_status(url)["iteration"] > it or get_status(url)["done"], 300,
                     "the iteration to end", run)
            if sum(r.get("faults/rerolled_groups", 0) + r.get("faults/dropped_groups", 0) for r in get_history(url)):
                break
        # A policy replica killed while it serves a rollout: its requests are retried on the other one, and its
        # replacement loads the run's latest weights before Serve routes anything to it.
        wait_for_phase(url, ("rollout",), run, 300, "a rollout")
        kill_one("ray::ServeReplica:train:Policy")
        # A Train worker killed: the job ends, the controller starts a new one from the last checkpoint, rolls the
        # run back to it and redoes the iterations after it.
        wait_for(lambda: get_status(url)["iteration"] >= 2 or get_status(url)["done"], 300, "iteration 2", run)
        kill_one("ray::RayTrainWorker")
        status = wait_for(lambda: (s := get_status(url))["done"] and s, 600, "the run to finish", run)
        assert status["phase"] == "done" and status["iteration"] == 4, status

        history = get_history(url)
        train = trained_records(history)
        assert [r["iteration"] for r in train] == [1, 2, 3, 4], "an iteration was lost or repeated"
        restarts = [r for r in history if r.get("phase") == "fault"]
        assert restarts and restarts[-1]["faults/trainer_restarts"] >= 1, "the Train job was not restarted"
        log = run.log.read_text()
        assert "synced to the run's weight version" in log, "the new replica did not sync"
        assert sum(r["faults/rerolled_groups"] + r["faults/dropped_groups"] for r in train) > 0, \
            "the killed actor's groups were neither re-rolled nor counted as dropped"
        assert all(r["data/rows"] > 0 for r in train)
        # The trainer's log-probs of the sampled replies (left-padded batches, logits of the reply positions only)
        # are the engine's: the first PPO ratio is 1 whichever way the behaviour log-probs are taken.
        assert all(r["train/rollout_trainer_logprob_gap"] < 1e-3 for r in train), \
            [r["train/rollout_trainer_logprob_gap"] for r in train]
        assert "val/random_policy_success" in history[0]
        assert any("val/success_rate" in r for r in train)

        # Every replica reports the final weight version, and the version counts every transfer: the warm start's,
        # each update that went out (one console line each, a redone iteration's too), each restore from a
        # checkpoint, each transfer over the group that failed and went through the object store instead (logged
        # once each), each re-broadcast to a replica that fell behind. A Train job that fails after its update went
        # out but before the iteration's line (in its checkpoint) adds one version no line shows: one per restart
        # at most.
        policy = serve.get_deployment_handle("Policy", app_name="train")
        versions = {i["version"] for i in policy.broadcast("info").results()}
        warm_start_broadcasts = sum(r.get("phase") == "warm_start" for r in history)
        assert warm_start_broadcasts == 1
        updates = log.count("[raygent] iter ")
        restores = sum(r.get("faults/restored_from") is not None for r in restarts)
        fallbacks = train[-1]["faults/weight_sync_fallbacks"]
        assert log.count("through the object store") == fallbacks, fallbacks
        resent = log.count("re-broadcasting")
        assert versions == {status["weight_version"]}
        counted = updates + warm_start_broadcasts + restores + fallbacks + resent
        assert counted <= status["weight_version"] <= counted + restarts[-1]["faults/trainer_restarts"], \
            (status, updates, restores, fallbacks, resent)

        checkpoint = Path(status["last_checkpoint"])
        assert checkpoint == run_dir / "checkpoints" / "iter_000004"
        for f in ("model/model.safetensors", "model/config.json", "model/tokenizer.json",
                  "train_state/.metadata", "train_state/__0_0.distcp", "train_state/__1_0.distcp", "state.json"):
            assert (checkpoint / f).exists(), f
        assert not list(checkpoint.parent.glob(".tmp-*")), "a temporary checkpoint folder was left behind"
        # keep: 1 (nothing pinned: the run started from the built model), here and in storage
        assert kept_checkpoints(run_dir) == ["iter_000004"]
        assert stored.folders("checkpoints") == ["iter_000004"], "rotation did not apply in storage"
        for f in (STORAGE_COMPLETE, "state.json", "model/model.safetensors", "model/raygent_agent.json",
                  "train_state/.metadata"):
            assert stored.exists(f"checkpoints/iter_000004/{f}"), f
        # The KL reference is the policy after the warm start, kept outside the rotating checkpoints.
        state = json.loads((checkpoint / "state.json").read_text())
        assert state["layout_version"] == LAYOUT_VERSION and state["reference_model"] == "reference"
        assert (run_dir / "reference" / "model.safetensors").exists()
        assert stored.exists("reference/model.safetensors") and stored.exists("metrics.jsonl")
        kl_before = [r["train/kl"] for r in train]
        assert kl_before[-1] > 0, kl_before

        # The run's gauges reach Ray's metrics agent under the names the Grafana dashboard draws.
        wanted = {prometheus_name(k) for k in ("weight_version", "train/success_rate", "train/kl", "val/success_rate",
                                               "time/iteration_s")}
        exported = scrape_metrics(until=wanted, timeout=30)
        assert wanted <= exported, sorted(n for n in exported if "raygent" in n)

        # The agent endpoint serves the checkpoint as it is: its folder says which env, memory and sampling.
        card = json.loads((checkpoint / "model" / "raygent_agent.json").read_text())
        assert card["env"]["name"] == "sokoban" and card["source"]["iteration"] == 4
        serve.run(build_agent_app({"policy": {"model": str(checkpoint / "model"), "engine": "hf"}}),
                  name="agent-ckpt", route_prefix="/ckpt")
        episode = httpx.post(f"{url}/ckpt/v1/episodes", json={"seed": 1}, timeout=120).json()
        assert episode["env"] == "sokoban" and episode["steps"] >= 1 and isinstance(episode["won"], bool)
        assert episode["sampling"]["max_tokens"] == card["sampling"]["max_tokens"]
        assert httpx.get(f"{url}/ckpt/v1/models", timeout=10).json()["data"][0]["id"] == "model"
    finally:
        run.stop()
    serve.delete("agent-ckpt")
    serve.delete("train")  # whatever serve run left behind: the next status must come from the resumed run

    # ---- 2. resume; an env-group actor, then the controller killed --------------------------------------------
    run = ServeRun(config(7, "stage2.yaml"), tmp_path / "stage2.log", address)
    try:
        # iteration 5 checkpointed: keep 1 would now rotate iter_000004 away, but the run's replicas and env-group
        # actors load their starting model from it, so it is pinned; a restarted actor finds it.
        wait_for(lambda: get_status(url)["iteration"] >= 5, 600, "iteration 5", run)
        wait_for_phase(url, ("rollout",), run, 300, "a rollout after iteration 5")
        os.kill(env_actor_pids()[0], signal.SIGKILL)
        # The controller killed: the ingress's health check starts it again, and it resumes from the latest
        # checkpoint; the metrics after that checkpoint are cut, so no iteration is logged twice.
        wait_for(lambda: (s := get_status(url))["iteration"] >= 6 and s["phase"] in ("rollout", "learning"), 300,
                 "iteration 6 to train", run)
        kill_one("ray::Controller")
        status = wait_for(lambda: (s := get_status(url))["done"] and s, 600, "the resumed run to finish", run)
    finally:
        run.stop()
    serve.delete("train")
    assert status["phase"] == "done" and status["iteration"] == 7, status
    history = read_history(run_dir)
    train = trained_records(history)
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6, 7]  # nothing repeated, nothing skipped
    log = run.log.read_text()
    resumed = re.findall(r"resuming e2e-tiny from \S*/(iter_\d+)", log)
    assert len(resumed) == 2 and resumed[0] == "iter_000004", resumed  # the run, then its restarted controller
    # The KL goes on from the same reference: a reference reloaded from the resumed weights would read exactly 0 on
    # the first minibatch after a resume.
    kl_after = {r["iteration"]: r["train/kl"] for r in train}
    assert kl_after[5] > 0.5 * kl_before[-1] and all(v > 0 for v in kl_after.values()), (kl_before, kl_after)
    # keep 1, plus what the run pinned: the checkpoint its processes start from, and the one its restarted
    # controller resumed from; storage keeps what the run folder keeps
    kept = sorted({"iter_000004", resumed[1], "iter_000007"})
    assert kept_checkpoints(run_dir) == kept
    assert stored.folders("checkpoints") == kept
    assert all(r["faults/storage_failures"] == 0 for r in train)


def test_async_rollout_bounds_staleness_survives_kills_and_stops_with_a_checkpoint(ray_cluster, serve_url, tmp_path):
    """`rollout.mode: async` with max_staleness 1, from `serve run`: the next iteration's rollout runs while the
    Train job updates (overlap > 0, rows one version old reach the loss), no row the trainer saw lags more than one
    version (the Train job's own check of every row), every group that trained was whole; an env-group actor and a
    replica killed mid-run cost only their unfinished episodes (redone, counted); `/stop` finishes the iteration,
    checkpoints it, drains the rollout started ahead and stops."""
    from ray import serve

    address = ray_cluster.get_runtime_context().gcs_address
    port = int(serve_url.rsplit(":", 1)[1])
    serve.delete("train")
    config = training_config(REPO / "serve_configs" / "test_tiny.yaml", tmp_path / "config.yaml", port,
                             tmp_path / "runs", run_name="e2e-async", iterations=30, warm_start={"enabled": False},
                             env={"name": "sokoban", "kwargs": {"max_steps": 6}},  # short untrained episodes
                             # The rollout ahead overlaps the update only when it lasts as long: the untrained
                             # model writes max_tokens of noise at every step, so 40 of them make a rollout ~3x an
                             # update. (Whether an update lands mid-episode is timing; test_policy shows that joint.)
                             rollout={"n_groups": 4, "group_size": 4, "num_env_actors": 2, "max_tokens": 40,
                                      "mode": "async", "max_staleness": 1},
                             optim={"lr": 1.0e-3, "minibatch_size": 128, "micro_batch_size": 64,
                                    "old_logprobs": "recompute", "rollout_correction": "tis"},
                             validation={"every": 0, "n_envs": 8, "baseline_envs": 0},
                             checkpoint={"every": 0, "keep": 2, "resume": "never"})
    run = ServeRun(config, tmp_path / "run.log", address)
    try:
        # An env-group actor killed while the Train job updates (the next iteration's rollout is then in flight);
        # again if that rollout had already finished.
        for _ in range(3):
            wait_for(lambda: get_status(serve_url)["phase"] == "learning", 600, "an update", run)
            it = get_status(serve_url)["iteration"]
            os.kill(env_actor_pids()[0], signal.SIGKILL)
            wait_for(lambda it=it: get_status(serve_url)["iteration"] >= it + 2, 600, "two more iterations", run)
            if sum(r.get("faults/rerolled_groups", 0) + r.get("faults/dropped_groups", 0)
                   for r in get_history(serve_url)):
                break
        kill_one("ray::ServeReplica:train:Policy")
        it = get_status(serve_url)["iteration"]
        wait_for(lambda: get_status(serve_url)["iteration"] >= it + 2, 600, "two more iterations", run)
        assert httpx.post(f"{serve_url}/stop", timeout=10).json()["stopping"]
        status = wait_for(lambda: (s := get_status(serve_url))["done"] and s, 600, "the run to stop", run)
    finally:
        run.stop()
    assert status["phase"] == "stopped" and 4 <= status["iteration"] < 30, status
    assert Path(status["last_checkpoint"]).name == f"iter_{status['iteration']:06d}"
    log = run.log.read_text()
    assert "draining 1 rollouts" in log, log[-3000:]
    history = [json.loads(line) for line in (tmp_path / "runs" / "e2e-async" / "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    train = [r for r in history if r.get("phase") == "train"]
    assert [r["iteration"] for r in train] == list(range(1, status["iteration"] + 1))
    for r in train:
        hist = r["train/staleness_hist"]
        assert len(hist) == 2 and r["train/staleness_max"] <= 1, r
        assert sum(hist) + r["train/too_stale_rows"] == r["data/rows"], r  # every row the trainer got is counted
        assert r["data/incomplete_groups"] == 0 and r["data/groups"] == 4, r
    assert sum(r["train/staleness_hist"][1] for r in train) > 0, "no row one version old: nothing overlapped"
    assert max(r["perf/overlap_share"] for r in train[1:]) > 0.5, [r["perf/overlap_share"] for r in train]
    assert sum(r["faults/rerolled_groups"] + r["faults/dropped_groups"] for r in train) > 0, \
        "the killed actor's groups were neither redone nor counted"


def test_policy_replicas_that_fit_no_node_fail_the_run_with_serves_reason(ray_cluster, serve_url, tmp_path):
    """The Policy deployment asks each replica for a resource no node has: instead of rollouts waiting for replicas
    that never start, the run fails after rollout.policy_timeout_s with Serve's own message, which names what each
    replica asks for."""
    import yaml
    from ray import serve

    address = ray_cluster.get_runtime_context().gcs_address
    port = int(serve_url.rsplit(":", 1)[1])
    serve.delete("train")
    config = training_config(REPO / "serve_configs" / "test_tiny.yaml", tmp_path / "config.yaml", port,
                             tmp_path / "runs", run_name="e2e-unplaced", warm_start={"enabled": False},
                             rollout={"n_groups": 4, "group_size": 4, "num_env_actors": 2, "max_tokens": 12,
                                      "policy_timeout_s": 10})
    spec = yaml.safe_load(config.read_text())
    (policy,) = [d for d in spec["applications"][0]["deployments"] if d["name"] == "Policy"]
    policy["ray_actor_options"]["resources"] = {"no_such_node": 1}
    policy["graceful_shutdown_timeout_s"] = 1  # replicas never placed: deleting the app need not wait 20 s for them
    config.write_text(yaml.safe_dump(spec))
    run = ServeRun(config, tmp_path / "run.log", address)
    try:
        status = wait_for(lambda: (s := get_status(serve_url))["done"] and s, 300, "the run to fail", run)
    finally:
        run.stop()
        serve.delete("train")
    assert status["phase"] == "failed", status
    assert "no Policy replica answered within rollout.policy_timeout_s" in status["error"], status
    assert "no_such_node" in status["error"], status


def test_a_full_checkpoint_disk_keeps_the_last_checkpoint_and_the_run_goes_on(tmp_path):
    """The run's checkpoint folder is a 256 MB tmpfs that fills up after the first checkpoint, inside a private
    mount namespace (CI runs as root: chmod cannot refuse a write). The run has its own Ray cluster in that
    namespace (`serve run` with no address, the session's /tmp/ray hidden), so the controller writes to the tmpfs.
    The refused checkpoint is logged and counted, the previous one stays intact and loadable, and once space is
    back the run checkpoints again and finishes."""
    import subprocess

    from tests.serve_helpers import SERVE
    from tests.update_helpers import free_port

    port = free_port()
    runs = tmp_path / "runs"
    checkpoints = runs / "e2e-full-disk" / "checkpoints"
    checkpoints.mkdir(parents=True)
    # The disk is the subject: transformers answers (`engine: hf`, started in seconds where vLLM takes ~30) and one
    # Train worker writes the train state (vLLM and 2 ranks: the other runs of this module).
    config = training_config(REPO / "serve_configs" / "test_tiny.yaml", tmp_path / "config.yaml", port, runs,
                             run_name="e2e-full-disk", iterations=4, warm_start={"enabled": False},
                             policy={"model": "default:tiny", "engine": "hf", "max_model_len": 1024},
                             trainer={"num_workers": 1, "strategy": "fsdp", "cpus_per_worker": 0.2},
                             checkpoint={"every": 1, "keep": 2, "resume": "never"})
    log = tmp_path / "run.log"
    script = (f"mount -t tmpfs tmpfs /tmp/ray && mount -t tmpfs -o size=256m tmpfs {checkpoints} && "
              f"exec {SERVE} run {config}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    class _Run:  # wait_for's view of a serve run
        pass

    run = _Run()
    run.proc, run.log = proc, log
    url = f"http://127.0.0.1:{port}"

    def inside(cmd: str) -> str:  # a command in the run's mount namespace (the tmpfs is invisible outside it)
        return subprocess.run(["nsenter", "-t", str(proc.pid), "-m", "sh", "-c", cmd], capture_output=True,
                              text=True, timeout=60).stdout

    def kept() -> list[str]:
        return sorted(n for n in inside(f"ls {checkpoints}").split() if n.startswith("iter_"))

    try:
        wait_for(lambda: "iter_000001" in kept(), 900, "the first checkpoint", run)
        inside(f"dd if=/dev/zero of={checkpoints}/filler bs=1M 2>/dev/null; true")  # the disk is now full
        failed = wait_for(lambda: [r for r in get_history(url) if r.get("faults/checkpoint_failures", 0) >= 1],
                          600, "a refused checkpoint", run)
        # The previous checkpoint is whole: copied out of the namespace and loaded as a resume would.
        inside(f"cp -r {checkpoints}/iter_000001 {tmp_path}/iter_000001")
        from actors.checkpoint import load_model_weights, load_state, train_state_of

        assert load_state(tmp_path / "iter_000001")["iteration"] == 1
        assert load_model_weights(tmp_path / "iter_000001" / "model")
        assert train_state_of(tmp_path / "iter_000001")["train_state"]
        assert not [n for n in inside(f"ls -a {checkpoints}").split() if n.startswith(".tmp-")], \
            "a half-written checkpoint was left on the full disk"
        inside(f"rm {checkpoints}/filler")
        status = wait_for(lambda: (s := get_status(url))["done"] and s, 900, "the run to finish", run)
        assert status["phase"] == "done" and status["iteration"] == 4, status
        assert kept()[-1] == "iter_000004", kept()
        assert failed[0]["iteration"] >= 2
        assert "checkpoint of iteration" in log.read_text() and "No space left" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.timeout(480)
def test_a_lora_run_sends_adapters_checkpoints_them_resumes_and_serves_base_plus_adapter(ray_cluster, serve_url,
                                                                                          tmp_path):
    """`policy.lora` from `serve run`: the Train job trains an adapter (FSDP2, the base frozen), the replicas serve
    base + adapter with vLLM's LoRA (the trainer's log-probs of the sampled replies are the engine's, before and
    after a resume), each update sends the adapter alone, a checkpoint holds the adapter and the merged model, the
    run's controller killed after the first checkpoint resumes from the latest (as a new `serve run` of the run
    would: the same resume at the controller's start, without paying for new replicas), and the agent endpoint
    serves the same agent from base + adapter as from the merged folder."""
    from ray import serve

    from app.agent import build_agent_app

    address = ray_cluster.get_runtime_context().gcs_address
    port = int(serve_url.rsplit(":", 1)[1])
    serve.delete("train")
    config = training_config(REPO / "serve_configs" / "test_tiny.yaml", tmp_path / "config.yaml", port,
                             tmp_path / "runs", run_name="e2e-lora", iterations=3, warm_start={"enabled": False},
                             env={"name": "sokoban", "kwargs": {"max_steps": 6}},
                             policy={"model": "default:tiny", "engine": "vllm", "max_model_len": 1024,
                                     "lora": {"rank": 8, "alpha": 32.0}},
                             validation={"every": 0, "n_envs": 8, "baseline_envs": 0},
                             checkpoint={"every": 1, "keep": 2, "resume": "auto"})
    runs = tmp_path / "runs" / "e2e-lora"
    run = ServeRun(config, tmp_path / "run.log", address)
    try:
        wait_for(lambda: (runs / "checkpoints" / "iter_000001" / "state.json").exists(), 600, "the first checkpoint",
                 run, interval=0.2)
        kill_one("ray::Controller")
        status = wait_for(lambda: (s := get_status(serve_url))["done"] and s, 600, "the resumed run", run)
    finally:
        run.stop()
    serve.delete("train")
    assert status["phase"] == "done" and status["iteration"] == 3, status
    resumed = re.findall(r"resuming e2e-lora from \S*/iter_(\d+)", run.log.read_text())
    assert len(resumed) == 1, run.log.read_text()[-3000:]  # the restarted controller, from a checkpoint
    resumed_from = int(resumed[0])
    assert resumed_from < 3, "the controller was killed after the run's last iteration: nothing was resumed"

    train = trained_records(read_history(runs))
    assert [r["iteration"] for r in train] == [1, 2, 3]  # the iterations after the resumed checkpoint, redone once
    # The replicas sample from exactly the trainer's policy: base + the adapter it sent (and after the resume,
    # base + the checkpoint's adapter): the first PPO ratio is 1 up to numerics.
    assert all(r["train/rollout_trainer_logprob_gap"] < 1e-3 for r in train), \
        [r["train/rollout_trainer_logprob_gap"] for r in train]
    # The reference is the base (the adapter off): a fresh adapter (B = 0) is the base, so iteration 1's KL is 0;
    # right after the resume it is not (the trained adapter came back, not a fresh one; KL is taken before each
    # iteration's one update).
    kl = {r["iteration"]: r["train/kl"] for r in train}
    assert kl[1] == 0 and kl[resumed_from + 1] > 0, (kl, resumed_from)

    checkpoint = runs / "checkpoints" / "iter_000003"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["layout_version"] == LAYOUT_VERSION and Path(state["base_model"]).is_dir()
    adapter_bytes = (checkpoint / "adapter" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < 0.5 * (checkpoint / "model" / "model.safetensors").stat().st_size
    assert json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())["r"] == 8

    # One agent, served two ways: the merged folder, and the base model plus the adapter folder.
    serve.run(build_agent_app({"policy": {"model": str(checkpoint / "model"), "engine": "hf"}}),
              name="agent-merged", route_prefix="/merged")
    serve.run(build_agent_app({"policy": {"model": state["base_model"], "adapter": str(checkpoint / "adapter"),
                                          "engine": "hf"}}), name="agent-adapter", route_prefix="/adapter")
    try:
        episodes = {}
        for route in ("merged", "adapter"):
            body = httpx.post(f"{serve_url}/{route}/v1/episodes", json={"seed": 4, "sampling_seed": 9,
                                                                         "return_tokens": True}, timeout=120)
            assert body.status_code == 200, body.text
            episodes[route] = body.json()
        assert episodes["adapter"]["env"] == "sokoban"  # the adapter folder's agent card
        merged, adapted = episodes["merged"]["trajectory"], episodes["adapter"]["trajectory"]
        assert [s["response_token_ids"] for s in adapted] == [s["response_token_ids"] for s in merged]
        for a, b in zip(adapted, merged, strict=True):
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    finally:
        serve.delete("agent-merged")
        serve.delete("agent-adapter")


def test_unwritable_storage_fails_before_any_actor_starts(s3_bucket):
    from app.train import build_train_app

    args = yaml.safe_load((REPO / "serve_configs" / "test_tiny.yaml").read_text())["applications"][0]["args"]
    missing_bucket = s3_bucket.format(key="x").replace("@raygent/", "@no-such-bucket/")
    with pytest.raises(ValueError) as e:
        build_train_app({**args, "checkpoint": {"storage": missing_bucket}})
    message = str(e.value)
    assert "args.checkpoint.storage: s3://no-such-bucket/" in message and "not writable" in message, message
    assert "test:test" not in message


@pytest.mark.timeout(1200)
def test_a_gpu_recipe_at_cpu_size_trains_the_real_model_syncs_checkpoints_serves_and_evaluates(ray_cluster, serve_url,
                                                                                             tmp_path):
    """The Sokoban GPU recipe (serve_configs/gpu/sokoban.yaml) run as benchmarks/bench_gpu_recipes_on_cpu.py runs
    every recipe: SmolLM2-135M-Instruct (the built-in `smollm2-135m`) in place of Qwen, only sizes, devices and
    engine settings changed, nccl's CPU twin gloo carrying the weights; here in float32 (the log-prob check below is
    tight), with one replica and a short warm start first (its path with a real model). The trainer's log-probs of
    the sampled replies are the engine's; the checkpoint is served by the agent endpoint with its path alone (the
    official openai client included), and `raygent eval` plays the run's held-out seeds with their sampling seeds as
    the run's own validation did. (Kills of replicas and Train workers are the lifecycle test's, with the tiny model
    on the same gloo group: with the real model each costs the suite a minute.)"""
    import subprocess
    import sys

    from openai import OpenAI
    from ray import serve

    from app.agent import build_agent_app
    from benchmarks.bench_gpu_recipes_on_cpu import cpu_sized

    address = ray_cluster.get_runtime_context().gcs_address
    port = int(serve_url.rsplit(":", 1)[1])
    serve.delete("train")
    spec, _ = cpu_sized(REPO / "serve_configs" / "gpu" / "sokoban.yaml", extra={
        "output_dir": str(tmp_path / "runs"), "run_name": "recipe-sokoban",
        "policy.dtype": "float32", "trainer.mixed_precision": "fp32", "weight_sync.timeout_s": 60,
        "warm_start": {"enabled": True, "demo_seeds": 8, "steps": 4, "batch_size": 8, "eval_every": 4,
                       "lr": 2.0e-5, "target_success": 1.0},
        # one validation and one checkpoint, the run's last (each costs the real model seconds: a checkpoint is
        # ~2 GB with the optimizer state), which the agent endpoint and `raygent eval` read back
        "validation.every": 2, "checkpoint.every": 2,
        "checkpoint.keep": 2, "checkpoint.resume": "never", "deployments.Policy.num_replicas": 1})
    spec["http_options"]["port"] = port
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(spec))
    run = ServeRun(config, tmp_path / "run.log", address)
    try:
        status = wait_for(lambda: (s := get_status(serve_url))["done"] and s, 900, "the run to finish", run)
        # the replica holds the run's last weights
        versions = {i["version"] for i in serve.get_deployment_handle("Policy", app_name="train")
                    .broadcast("info").results()}
    finally:
        run.stop()
        serve.delete("train")
    assert status["phase"] == "done" and status["iteration"] == 2, status
    assert versions == {status["weight_version"]}, (versions, status)
    history = read_history(tmp_path / "runs" / "recipe-sokoban")
    train = trained_records(history)
    assert [r["iteration"] for r in train] == [1, 2]
    # the replicas hold the trainer's weights after every update (over the gloo group), in float32
    assert all(r["train/rollout_trainer_logprob_gap"] < REAL_MODEL_LOGPROB_GAP for r in train), \
        [r["train/rollout_trainer_logprob_gap"] for r in train]
    checkpoint = Path(status["last_checkpoint"]) / "model"
    card = json.loads((checkpoint / "raygent_agent.json").read_text())
    assert card["env"]["name"] == "sokoban" and card["source"]["iteration"] == 2

    # Served with the path alone; the official openai client gets chat completions from it.
    serve.run(build_agent_app({"policy": {"model": str(checkpoint)}}), name="real-agent", route_prefix="/real")
    try:
        client = OpenAI(base_url=f"{serve_url}/real/v1", api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(model="model", max_tokens=12, messages=[
            {"role": "user", "content": "In Sokoban, which moves can a player make?"}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        episode = httpx.post(f"{serve_url}/real/v1/episodes", json={"seed": 2, "split": "val"}, timeout=300).json()
        assert episode["env"] == "sokoban" and episode["steps"] >= 1, episode
    finally:
        serve.delete("real-agent")

    # `raygent eval`: the run's held-out seeds with the validation's sampling seeds play the validation's episodes.
    report = tmp_path / "eval.json"
    raygent = str(Path(sys.executable).with_name("raygent"))
    done = subprocess.run([raygent, "eval", "--checkpoint", str(checkpoint), "--seeds", "4",
                           "--out", str(report)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (split,) = json.loads(report.read_text())["splits"].values()
    assert split["summary"]["success_rate"] == pytest.approx(train[-1]["val/success_rate"])
    assert split["summary"]["return"] == pytest.approx(train[-1]["val/return"], abs=1e-6)
