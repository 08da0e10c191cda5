"""Start Ray (or join a cluster), run the application, wait for Ctrl-C or SIGTERM, drain, stop."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from ..errors import UsageError
from .app import DRAIN_S, build_app
from .folder import ServedFolder
from .local_ray import start_local_ray, stop_local_ray


PROXY_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
# Ray runs its workers (our replicas) at nice 15 and its own daemons at 0: on a machine the model
# fills, the daemons' periodic work then takes the replica's cores (a 512-token embedding: 1.26 s
# at nice 15, 1.14 s at 0, 1.0 s in a plain process; docs/serving.md). A cluster sets it at `ray start`.
WORKER_NICENESS = {"RAY_worker_niceness": "0"}
# An idle local server's Ray took 20% of one core (2 vCPUs: 10% of the machine the model works on),
# most of it Serve's controller loop (10 times a second) and Ray's own metrics, which nothing here
# reads (/metrics is the application's). With these: 13%. The controller then notices a dead
# replica within a second, not a tenth (docs/serving.md). A cluster keeps its own settings.
QUIET_DAEMONS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1", "RAY_enable_metrics_collection": "false"}


def _check_port(host: str, port: int) -> None:
    """The port can be listened on: refused in one line before Ray starts, not after."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def launch(served: ServedFolder, host: str, port: int, replicas: int, address: str | None,
           max_batch_tokens: int | None, threads: int, slots: int | None) -> int:
    import ray
    from ray import serve

    if address is None:
        _check_port(host, port)
    # a busy machine starts Ray's HTTP proxy in more than Serve's 5 s ready check (it then kills the
    # proxy and serve.start fails): give it a minute; local workers inherit this environment
    for name, value in {**PROXY_TIMEOUTS, **WORKER_NICENESS, **({} if address else QUIET_DAEMONS)}.items():
        os.environ.setdefault(name, value)
    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        node = None
    else:
        node = start_local_ray(os.cpu_count() or 1)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "ERROR"})
        app = build_app(str(served.path), replicas, threads, max_batch_tokens, slots)
        try:
            serve.run(app, name=served.name, route_prefix="/", blocking=False)
        except RuntimeError as err:  # a replica that cannot load the folder: Serve's report, one line
            raise UsageError(f"cannot serve {served.path}: {_first_cause(str(err))}") from None
        print(f"serving {served.name} ({served.role}, {replicas} replica{'s' * (replicas > 1)}) at "
              f"http://{host}:{port}/v1; Ctrl-C or SIGTERM stops", flush=True)
        stop.wait()
        print(f"stopping: requests in flight get up to {DRAIN_S} s", file=sys.stderr, flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown() if node is None else stop_local_ray(node)
    return 0


def _first_cause(report: str) -> str:
    """The line of a Serve deployment failure that names the cause (the replica's exception)."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    causes = [line for line in lines if ("Error:" in line or "Exception:" in line) and not line.startswith("File ")]
    return (causes[-1] if causes else lines[0] if lines else "its replica failed to start")[:300]
