"""The episode runner's request coalescing: the prompts of many concurrent episodes go out as few batched requests,
at most `chunks` at a time, however the replies come back."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from actors.episodes import Coalescer, Lanes


def _run(n_episodes: int, steps: int, chunks: int, delays: list[float], fail_at: int | None = None):
    sizes: list[int] = []
    in_flight, most_in_flight = 0, 0
    delay = itertools.cycle(delays)

    async def send(prompts, samplings):
        nonlocal in_flight, most_in_flight
        sizes.append(len(prompts))
        number = len(sizes)
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        try:
            await asyncio.sleep(next(delay))
            if number == fail_at:
                raise RuntimeError("replica died")
            return [{"prompt": p, "seed": s["seed"]} for p, s in zip(prompts, samplings, strict=True)]
        finally:
            in_flight -= 1

    async def main():
        coalescer = Coalescer(send, chunks)

        async def episode(i: int) -> list[dict]:
            return [await coalescer.generate([i], {"seed": t}) for t in range(steps)]

        return await asyncio.gather(*(episode(i) for i in range(n_episodes)), return_exceptions=True)

    return asyncio.run(main()), sizes, most_in_flight


@pytest.mark.parametrize("delays", [[0.01], [0.005, 0.03], [0.03, 0.005, 0.012]])
def test_replies_at_different_times_do_not_fragment_the_requests(delays):
    results, sizes, most_in_flight = _run(n_episodes=128, steps=15, chunks=2, delays=delays)
    # every episode got its own replies, in order
    assert all(r == [{"prompt": [i], "seed": t} for t in range(15)] for i, r in enumerate(results))
    assert most_in_flight <= 2
    # two requests of 64 per step (a fixed split of every flush gave 64, 32, 16, ... 1 prompts per request)
    assert len(sizes) <= 2 * 15 + 2, sizes
    assert min(sizes) >= 32, sizes


def test_a_failed_request_fails_only_its_episodes():
    results, sizes, _ = _run(n_episodes=8, steps=3, chunks=2, delays=[0.01], fail_at=1)
    failed = [r for r in results if isinstance(r, RuntimeError)]
    assert len(failed) == sizes[0] == 4  # the first request carried half of the first step's prompts
    assert all(isinstance(r, list) and len(r) == 3 for r in results if not isinstance(r, RuntimeError))


def test_lanes_keep_each_group_on_one_lane_and_name_it():
    """`Lanes`: group g's prompts only ever travel on lane g % lanes, named as the request's affinity key (which
    the Policy's router maps to one replica), with one request in flight per lane; the busy clock counts the time
    with any lane in flight once."""
    requests: list[tuple[int, set[int]]] = []

    async def send(prompts, samplings, affinity=None):
        requests.append((affinity, {p[0] for p in prompts}))
        await asyncio.sleep(0.01 * (1 + affinity))
        return [{"prompt": p} for p in prompts]

    async def main():
        lanes = Lanes(send, 3)
        groups = [i // 4 for i in range(24)]  # 6 groups of 4 envs

        async def episode(i: int) -> None:
            generate = lanes.for_group(groups[i])
            for _ in range(5):
                await generate([groups[i]], {})

        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(episode(i) for i in range(24)))
        return lanes.busy_seconds, asyncio.get_running_loop().time() - started

    busy, wall = asyncio.run(main())
    assert {key for key, _ in requests} == {0, 1, 2}
    assert all(group % 3 == key for key, groups in requests for group in groups), requests
    assert sum(1 for key, _ in requests if key == 2) == 5  # one request per step: the lane's 8 envs go together
    assert 0.1 < busy <= wall + 1e-6  # the union of the lanes' in-flight time, not their sum (0.3 s)
