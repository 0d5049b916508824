"""How requests reach the Policy replicas: an `affinity` key keeps related requests on one replica, so the prompts
it has already seen are in that replica's prefix cache.

An env-group actor sends each group's prompts on one of a few lanes (`actors.episodes.Lanes`: group g on lane
g % lanes) and names the lane as the key: the G envs of a group share their first prompt, and every later prompt of a
trajectory goes to the replica that holds its earlier ones. Key k goes to replica k mod n of the deployment's replicas
in a fixed order (their ids), the same in every caller's router, so the lanes of all actors spread evenly over the
replicas; while that replica's queue is full the next one in the order takes the request. A request without a key is
routed as Serve does by default: the shorter queue of two replicas drawn at random.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTER = "app.routing:AffinityRouter"


class AffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if not isinstance(key, int) or isinstance(key, bool) or not candidate_replicas:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        # the order over all running replicas, not only today's candidates: a replica whose queue is full for a
        # moment must not shift every other key to another replica
        order = sorted(self.curr_replicas, key=lambda rid: rid.unique_id)
        start = key % len(order)
        available = {r.replica_id: r for r in candidate_replicas}
        ranked = [available[rid] for rid in order[start:] + order[:start] if rid in available]
        return [[r] for r in ranked]
