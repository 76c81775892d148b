"""Build the fleet: a Ray Serve application of ``KameraReplica`` deployments behind ``FleetIngress``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from kamera_sdk import Engine, InvalidInputError

from .ingress import FleetIngress
from .replica import KameraReplica
from .router import SessionRouter


@dataclass
class FleetConfig:
    """What a fleet runs: the engine each replica loads, the shared Redis, and how many replicas.

    ``replicas``: a fixed count, or ``min_replicas``/``max_replicas`` for Ray Serve's autoscaler (on
    ongoing requests per replica, ``target_ongoing_requests``). ``secret``: the store's entries are
    HMAC-tagged with it and only tagged entries are used. ``replica_cpus``: Ray CPUs each replica reserves.
    """

    engine_factory: Callable[[], Engine]
    store_url: str
    replicas: int | None = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    secret: str | None = None
    journal_prefix: str = "kamera:fleet:"
    session_ttl_s: float | None = 3600.0
    replica_cpus: float = 1.0
    max_ongoing_requests: int = 64
    app_options: dict[str, Any] = field(default_factory=dict)

    def scaling(self) -> dict[str, Any]:
        """The deployment options that size the replica set."""
        if self.min_replicas is not None or self.max_replicas is not None:
            lo, hi = self.min_replicas or 1, self.max_replicas or max(1, self.min_replicas or 1)
            if not 1 <= lo <= hi:
                raise InvalidInputError(f"need 1 <= min_replicas <= max_replicas, got {lo} and {hi}")
            return {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi,
                                           "target_ongoing_requests": self.target_ongoing_requests}}  # fmt: skip
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidInputError(f"replicas must be an int >= 1, got {self.replicas!r}")
        return {"num_replicas": self.replicas}


def build_app(config: FleetConfig) -> Application:
    """The Serve application: bind it with ``serve.run(build_app(cfg), route_prefix="/")``."""
    if not config.store_url.startswith(("redis://", "rediss://", "unix://")):
        raise InvalidInputError(f"a fleet needs a shared Redis store (redis://...), got {config.store_url!r}")
    replica = serve.deployment(
        KameraReplica,
        name="KameraReplica",
        ray_actor_options={"num_cpus": config.replica_cpus},
        max_ongoing_requests=config.max_ongoing_requests,
        graceful_shutdown_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=SessionRouter,
            request_router_kwargs={"redis_url": config.store_url, "prefix": config.journal_prefix},
        ),
        **config.scaling(),
    ).bind(
        config.engine_factory,
        config.store_url,
        secret=config.secret,
        journal_prefix=config.journal_prefix,
        session_ttl_s=config.session_ttl_s,
        app_options=config.app_options,
    )
    ingress = serve.deployment(FleetIngress, name="FleetIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1024)  # fmt: skip
    return ingress.bind(replica)
