"""Kamera on Ray Serve: engines as replicas, session-affine routing, sessions journaled in Redis.

    from kamera_fleet import FleetConfig, build_app
    serve.run(build_app(FleetConfig(Engine.load, "redis://cache:6379/0", replicas=2)), route_prefix="/")

Clients (``RemoteWindow``, OpenAI clients) talk to the fleet's HTTP address as to ``kamera serve``.
Needs the ``fleet`` extra (``pip install 'kamera[fleet]'``). See docs/fleet.md.
"""

from .app import FleetConfig, build_app
from .ingress import FleetIngress, route_key
from .journal import JournalLostError, SessionJournal, WindowRecord
from .replica import KameraReplica
from .router import SessionRouter

__all__ = [
    "FleetConfig",
    "FleetIngress",
    "JournalLostError",
    "KameraReplica",
    "SessionJournal",
    "SessionRouter",
    "WindowRecord",
    "build_app",
    "route_key",
]
