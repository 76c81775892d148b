"""``kamera fleet up``: start the fleet on a local Ray cluster, or attach to a running one (``--address``)."""

from __future__ import annotations

import argparse
import os
import signal
import time

from kamera_sdk import KameraError

#: the Serve application ``kamera fleet up`` deploys
APP = "kamera"


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
        args.load_engine,  # the model, device and dtype (and vision flags) of kamera fleet up
        args.store,
        replicas=None if autoscale else args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        secret=args.secret or os.environ.get("KAMERA_FLEET_SECRET") or None,
        replica_cpus=args.replica_cpus,
        app_options=args.app_options,  # batching, the KV budget and step sizes (kamera fleet up's flags)
    )
    serve.run(build_app(config), route_prefix="/", name=APP)
    return f"http://{args.host}:{args.port}"


def failed_deployment_error(app: str = APP) -> str | None:
    """The last line of the error that made a deployment of the Serve application ``app`` fail (a replica's
    constructor raised; ``serve.status()``), if any."""
    from ray import serve

    try:
        status = serve.status().applications.get(app)
    except Exception:  # no controller to ask: the caller reports what it has
        return None
    for deployment in status.deployments.values() if status is not None else ():
        lines = [ln.strip() for ln in (deployment.message or "").splitlines() if ln.strip()]
        if deployment.status == "DEPLOY_FAILED" and lines:
            return lines[-1]
    return None


def _stop(args: argparse.Namespace) -> None:
    """Take the fleet down: on a cluster it attached to (``--address``) only its application, which may share
    Serve with others; on the local cluster it started, Serve and Ray."""
    import ray
    from ray import serve

    if args.address:
        serve.delete(APP)
    else:
        serve.shutdown()
    ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def up(args: argparse.Namespace) -> int:
    """Deploy the fleet and serve until interrupted (Ctrl-C, SIGINT or SIGTERM), then shut the application
    down. The handlers are installed here: a process started in the background by a shell inherits SIGINT
    ignored, and Python then never turns it into ``KeyboardInterrupt``."""
    import ray

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        url = start(args)
    except (RuntimeError, ConnectionError, KameraError) as exc:  # a replica that cannot start fails the deployment
        why = str(exc)
        if ray.is_initialized():  # (asking serve.status() without Ray would start it)
            why = failed_deployment_error() or why
            _stop(args)
        raise KameraError(f"the fleet did not start: {why}") from exc
    print(f"kamera fleet serving on {url} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _stop(args)
    return 0
