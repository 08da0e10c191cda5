"""`serve DIR --address ADDR`: a Ray cluster that is not ours. Other applications may run on it,
and Serve's HTTP proxy may already be running there. So:

- a connection that fails is one line. Ray (2.60) sends a token only to a cluster it found on
  its own (`--address auto`), so a named address to a cluster with token authentication fails
  after about 40 s of retries; the line then says what to set;
- the proxy's host and port are the cluster's once Serve runs there (Serve ignores new ones):
  other values are refused, not printed as a URL nobody answers;
- another application at our route ("/") is refused in one line, and nothing of it is touched;
- at the end only our application is deleted. Serve is shut down only if this process started it
  and nothing else runs on it. `serve.shutdown()` would stop every application on the cluster.
"""
from __future__ import annotations

import os

from ..errors import UsageError

AUTH_HINT = ("a cluster with token authentication also needs RAY_AUTH_MODE=token and its token "
             "(RAY_AUTH_TOKEN, or ~/.ray/auth_token on this machine)")


def join(address: str) -> None:
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as err:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else f"; {AUTH_HINT}"
        raise UsageError(f"cannot join the Ray cluster at {address}: {_line(err)}{hint}") from None


def serve_running() -> bool:
    """Whether Serve's controller runs on the connected cluster (serve.start would join it)."""
    from ray import serve

    return bool(serve.status().proxies) or _client() is not None


def check_proxy(host: str, port: int) -> None:
    """Once Serve runs on the cluster, its proxy's host and port are the ones it was started with."""
    client = _client()
    http = getattr(client, "http_config", None)
    if http is None:  # Serve's internals moved: nothing to compare against
        return
    if (http.host, http.port) != (host, port):
        raise UsageError(f"Ray Serve on this cluster listens on {http.host}:{http.port} (the cluster's proxy "
                         f"keeps the options it started with): pass --host {http.host} --port {http.port}")


def check_route(name: str) -> None:
    """Our application takes the route "/": another application there is refused."""
    from ray import serve

    for other in serve.status().applications:
        if other != name and _route(other) == "/":
            raise UsageError(f"Ray Serve on this cluster already serves the application {other!r} at /; "
                             "serve takes that route: delete it first (ray.serve.delete) or use another cluster")


def leave(name: str, started_serve: bool) -> None:
    """Our application deleted; Serve shut down only when this process started it and no other
    application is left on it."""
    from ray import serve

    if name in serve.status().applications:
        serve.delete(name)
    if started_serve and not serve.status().applications:
        serve.shutdown()


def _client():
    from ray.serve.context import _get_global_client

    try:
        return _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - no controller, or Serve's internals moved
        return None


def _route(app: str) -> str | None:
    client = _client()
    try:
        return client.get_serve_details()["applications"][app]["route_prefix"]
    except Exception:  # noqa: BLE001 - unknown: Serve's own refusal at deploy time still holds
        return None


def _line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
