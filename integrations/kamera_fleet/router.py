"""Session-affine routing: a Ray Serve request router that sends a session's requests to its owner.

Each request carries its session id as Serve's ``multiplexed_model_id``. The owner of a session (the replica
that created or last rebuilt its window) is recorded in the session's journal head in Redis before the
replica answers, so the router knows it from the very next request; Serve's own multiplexing bookkeeping
(the session ids each replica reports holding) only catches up after its periodic push, which is why the
owner is read from the journal rather than from that report. A session whose owner is not among the
running replicas (dead, scaled away), and a new session, go to the replicas holding the fewest sessions
(ranked; Serve's power-of-two choice on queue length picks within a rank).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import MultiplexMixin, PendingRequest, RequestRouter, RunningReplica


class SessionRouter(MultiplexMixin, RequestRouter):
    """Owner first, then the least-loaded replicas by sessions held."""

    def initialize_state(self, redis_url: str = "", prefix: str = "kamera:fleet:", **_: Any) -> None:
        import redis.asyncio

        self._redis = redis.asyncio.Redis.from_url(redis_url) if redis_url else None
        self._prefix = prefix

    async def _owner(self, session: str) -> str | None:
        if self._redis is None or not session.startswith("ks_"):
            return None
        try:
            owner = await self._redis.hget(f"{self._prefix}s:{session}", "owner")
        except Exception:  # Redis away: route by load; the replica reports the journal error itself
            return None
        return owner.decode() if owner else None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if session:
            owner = await self._owner(session)
            if owner is not None:
                mine = [r for r in candidate_replicas if r.replica_id.unique_id == owner]
                if mine:
                    return [mine]
            holders = [r for r in candidate_replicas if session in r.multiplexed_model_ids]
            if holders:  # a chat window keyed by user: held where its last request ran
                return [holders]
        by_load: dict[int, list[RunningReplica]] = {}
        for r in candidate_replicas:
            by_load.setdefault(len(r.multiplexed_model_ids), []).append(r)
        return [by_load[k] for k in sorted(by_load)]
