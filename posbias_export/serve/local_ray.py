"""The one-machine Ray that `serve` starts when no cluster is named: the processes a Serve
application needs, without the three `ray.init` adds for a cluster. Measured on jina-v2-base's
folder (docs/serving.md), those three held 278 MiB of the 2442 the tree peaked at over 8192 tokens:
- the autoscaler's monitor (83 MiB): nothing to scale on one machine with no cluster config;
- the log monitor (79 MiB): it forwards workers' output to the driver, which `serve` turns off;
- the API server (116 MiB): the dashboard's, job and state REST endpoints, which nothing of ours
  calls (the application's routes are served by Serve's own proxy).
`ray start` offers the first two as flags; ray.init offers none, so the node is started here."""
from __future__ import annotations


def start_local_ray(num_cpus: int):
    """Start a head node on this machine and connect this process to it as the driver; returns the
    node, which `stop_local_ray` takes down. Its processes die with this one (Ray's fate sharing)."""
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    class LeanHead(Node):
        def start_api_server(self, **_):  # the dashboard's REST server: not started (see above)
            return None

    params = RayParams(num_cpus=num_cpus, include_dashboard=False, no_monitor=True, include_log_monitor=False)
    node = LeanHead(params, head=True, shutdown_at_exit=False, spawn_reaper=True, ray_init_cluster=True)
    try:
        ray.init(address=node.address, logging_level="ERROR", log_to_driver=False)
    except BaseException:
        node.kill_all_processes(check_alive=False, allow_graceful=False)
        raise
    return node


def stop_local_ray(node) -> None:
    """Disconnect the driver, then stop the node's processes (gracefully: the control store flushes)."""
    import ray

    try:
        ray.shutdown()
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=True)
