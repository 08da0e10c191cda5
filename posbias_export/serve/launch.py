"""Start Ray (or join a cluster), run the application, wait for Ctrl-C or SIGTERM, drain, stop."""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading

from ..errors import UsageError
from . import cluster
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
           max_batch_tokens: int | None, threads: int, slots: int | None, max_replicas: int | None = None,
           allow_origins=()) -> int:
    import ray

    if address is None:
        _check_port(host, port)
    # a busy machine starts Ray's HTTP proxy in more than Serve's 5 s ready check (it then kills the
    # proxy and serve.start fails): give it a minute; local workers inherit this environment
    for name, value in {**PROXY_TIMEOUTS, **WORKER_NICENESS, **({} if address else QUIET_DAEMONS)}.items():
        os.environ.setdefault(name, value)
    cpus = None  # on a cluster: each replica reserves its --threads (build_app)
    if address:
        cluster.join(address)
        node = None
    else:
        cores = machine_cpus()
        threads, cpus = local_threads(threads, replicas, max_replicas, cores)
        node = start_local_ray(cores)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    started_serve = None  # on a cluster: whether this process started Serve there (None: not yet asked)
    try:
        started_serve = _start_serve(host, port, served.name, on_cluster=node is None)
        _run_app(served, replicas, threads, max_batch_tokens, slots, max_replicas, allow_origins, cpus)
        scale = f" of up to {max_replicas}" if max_replicas and max_replicas > replicas else ""
        print(f"serving {served.name} ({served.role}, {replicas} replica{'s' * (replicas > 1)}{scale}) at "
              f"http://{host}:{port}/v1; Ctrl-C or SIGTERM stops", flush=True)
        stop.wait()
        print(f"stopping: requests in flight get up to {DRAIN_S} s", file=sys.stderr, flush=True)
    finally:
        _stop(served.name, node, started_serve)
    return 0


def machine_cpus() -> int:
    """The CPUs this process may use: its affinity, and a container's CPU quota (Ray's own count)."""
    try:
        from ray._private.utils import get_num_cpus

        return max(1, min(len(os.sched_getaffinity(0)), int(get_num_cpus())))
    except (ImportError, AttributeError, OSError, ValueError):  # Ray's private helper moved; no affinity here
        return os.cpu_count() or 1


def local_threads(threads: int, replicas: int, max_replicas: int | None, cores: int) -> tuple[int, int]:
    """(ONNX Runtime threads, CPUs reserved) of each replica on this machine: --threads for both; or
    (0) a lone replica's session chooses its own on the whole machine, and several share its cores
    evenly (two sessions spinning on the same cores slow each other down). UsageError where they
    cannot all fit: Ray would leave the rest waiting for cores that never come."""
    most = max(replicas, max_replicas or 0)
    if not threads and most == 1:
        return 0, cores
    chosen = threads or max(1, cores // most)
    if chosen * most > cores:
        count = f"--max-replicas {most}" if most > replicas else f"--replicas {most}"
        raise UsageError(f"{count} x --threads {chosen} needs {chosen * most} CPUs; this machine has {cores} "
                         "(each replica reserves the cores its threads run on)")
    return chosen, chosen


def _start_serve(host: str, port: int, name: str, on_cluster: bool) -> bool:
    """Serve started (or, on a cluster where it runs already, joined with its proxy's options
    checked and our route free); whether this process started it."""
    from ray import serve

    running = on_cluster and cluster.serve_running()
    if running:
        cluster.check_proxy(host, port)
        cluster.check_route(name)
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "ERROR"})
    return not running


def _run_app(served: ServedFolder, replicas: int, threads: int, max_batch_tokens: int | None,
             slots: int | None, max_replicas: int | None, allow_origins=(), cpus: int | None = None) -> None:
    from ray import serve

    app = build_app(str(served.path), replicas, threads, max_batch_tokens, slots, max_replicas, allow_origins, cpus)
    try:
        serve.run(app, name=served.name, route_prefix="/", blocking=False)
    except Exception as err:  # a replica that cannot load the folder, a route taken: Serve's report, one line
        raise UsageError(f"cannot serve {served.path}: {_first_cause(_deploy_report(served.name, err))}") from None


def _stop(name: str, node, started_serve: bool | None) -> None:
    """This machine's Ray: Serve and Ray stopped. A cluster: our application alone (cluster.leave)."""
    import ray
    from ray import serve

    try:
        if node is not None:
            serve.shutdown()
        elif started_serve is not None:
            cluster.leave(name, started_serve)
    finally:
        ray.shutdown() if node is None else stop_local_ray(node)


def _deploy_report(name: str, err: BaseException) -> str:
    """What serve.run's error says, and after it what each deployment's status says: on a cluster
    the error names only the deployments that failed, their status the replica's exception."""
    from ray import serve

    try:
        app = serve.status().applications.get(name)
        messages = [d.message for d in app.deployments.values() if d.message] if app else []
    except Exception:  # noqa: BLE001 - the error alone, then
        messages = []
    return "\n".join([str(err), *messages])


def _first_cause(report: str) -> str:
    """The line of a Serve deployment failure that names the cause (the replica's exception)."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    causes = [line for line in lines if ("Error:" in line or "Exception:" in line) and not line.startswith("File ")]
    cause = causes[-1] if causes else lines[0] if lines else "its replica failed to start"
    # the exception's class without its module path (ray.serve.exceptions.RayServeException: ...)
    return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", cause)[:300]
