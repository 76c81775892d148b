"""``kamera fleet up``: start the fleet on a local Ray cluster, or attach to a running one (``--address``)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from functools import partial

from kamera_sdk import Engine


def start(args: argparse.Namespace) -> str:
    """Start (or attach to) Ray, deploy the fleet and return its HTTP address once every replica is ready."""
    import ray
    from ray import serve

    from .app import FleetConfig, build_app

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    autoscale = args.min_replicas is not None or args.max_replicas is not None
    config = FleetConfig(
        partial(Engine.load, args.model, device=args.device, dtype=args.dtype),
        args.store,
        replicas=None if autoscale else args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        secret=args.secret or os.environ.get("KAMERA_FLEET_SECRET") or None,
        replica_cpus=args.replica_cpus,
    )
    serve.run(build_app(config), route_prefix="/", name="kamera")
    return f"http://{args.host}:{args.port}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def up(args: argparse.Namespace) -> int:
    """Deploy the fleet and serve until interrupted (Ctrl-C, SIGINT or SIGTERM), then shut the application
    down. The handlers are installed here: a process started in the background by a shell inherits SIGINT
    ignored, and Python then never turns it into ``KeyboardInterrupt``."""
    import ray
    from ray import serve

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    url = start(args)
    print(f"kamera fleet serving on {url} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()
    return 0
