"""``kamera fleet up``: its arguments; the fleet itself lives in the ``kamera_fleet`` integration (loaded on use)."""

from __future__ import annotations

import argparse
from importlib import import_module
from typing import Any

from .cli_args import (
    add_batching_flags,
    add_limit_flags,
    add_vision_flags,
    batching_options,
    engine_loader,
    limit_options,
    port,
    positive,
)


def _up(args: argparse.Namespace) -> int:
    # each replica's create_app options; a contradiction is refused before Ray starts
    args.app_options = batching_options(args) | limit_options(args)
    args.load_engine = engine_loader(args)  # each replica loads its engine with this
    try:
        cli = import_module("kamera_fleet.cli")
    except ImportError as exc:
        from kamera_engine import UnsupportedModelError

        raise UnsupportedModelError(f"kamera fleet needs the fleet extra: pip install 'kamera[fleet]' ({exc})") from exc
    return int(cli.up(args))


def add_fleet_command(sub: Any) -> None:
    """Register ``kamera fleet up`` on the main parser's subparsers."""
    fleet = sub.add_parser("fleet", help="run engines as a Ray Serve fleet (sessions journaled in Redis)")
    actions = fleet.add_subparsers(dest="fleet_action", required=True)
    up = actions.add_parser("up", help="start the fleet on a local Ray cluster, or attach with --address")
    up.add_argument("--store", required=True, help="the shared Redis: redis://host:6379/0 (store and journal)")
    up.add_argument("--address", default=None, help="a running Ray cluster (ray://head:10001 or auto)")
    up.add_argument("--replicas", type=positive, default=1, help="fixed replica count (default: %(default)s)")
    up.add_argument("--min-replicas", type=positive, default=None, help="autoscaling lower bound")
    up.add_argument("--max-replicas", type=positive, default=None, help="autoscaling upper bound")
    up.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")
    up.add_argument("--num-cpus", type=positive, default=None, help="CPUs of a local cluster started here")
    up.add_argument("--host", default="127.0.0.1", help="HTTP interface (default: %(default)s)")
    up.add_argument("--port", type=port, default=8000, help="HTTP port (default: %(default)s)")
    up.add_argument("--secret", default=None, help="store entries' HMAC secret (default: $KAMERA_FLEET_SECRET)")
    up.add_argument("--model", default=None, help="HF id or local path (default: the embedded SmolLM2-135M)")
    up.add_argument("--device", default=None, help="cpu or cuda")
    up.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    add_batching_flags(up)  # each replica's server, as kamera serve's
    add_limit_flags(up)
    add_vision_flags(up)
    up.set_defaults(func=_up)
