"""The episode runner's request coalescing: the prompts of many concurrent episodes go out as few batched requests,
at most `chunks` at a time, however the replies come back."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from actors.episodes import Coalescer


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
