"""`serve DIR --address ADDR` on a Ray cluster someone else started (`ray start --head`, its own
process group, killed whole at the end): the folder named relative to the caller's directory
reaches replicas that run elsewhere; --replicas 2 makes two; a second `serve` that cannot share the
cluster's proxy (another port) or its route (another folder at /) is refused in one line and leaves
the first serving; SIGTERM deletes our application and leaves the cluster up. And the RayService
manifest docs/serving.md gives, deployed from its serveConfigV2 as KubeRay deploys it."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

from hf_folders import save_client_model, save_tiny_folder, save_tokenizer  # noqa: E402
from test_serve import command_line  # noqa: E402
from posbias_export.hf.ship import ship  # noqa: E402
from posbias_export.peers.servers import STARTUP_S, free_port, tree_pids  # noqa: E402
from posbias_export.serve.process import ServeProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# a cluster of our own making: no token (Ray's default would write one under ~/.ray), no stats
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


class Cluster:
    """`ray start --head` in a new session: every daemon and worker of it shares its process group."""

    def __init__(self):
        self.port = free_port()
        self.temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        ray = Path(sys.executable).with_name("ray")
        self.process = subprocess.Popen(
            [str(ray), "start", "--head", "--port", str(self.port), "--num-cpus", "4", "--include-dashboard",
             "false", "--disable-usage-stats", "--temp-dir", self.temp, "--block"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **CLUSTER_ENV})
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.time() + STARTUP_S
        while not _listening(self.port):
            assert self.process.poll() is None and time.time() < deadline, "ray start --head failed"
            time.sleep(1)

    def members(self) -> set[int]:
        """The head's daemons (its process group) and their children (workers take groups of their own)."""
        group = os.getpgid(self.process.pid)
        daemons = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == group]
        return set().union(*(tree_pids(pid) for pid in daemons))

    def processes(self, name: str) -> list[int]:
        """This cluster's processes whose command line contains `name` (Ray renames its workers)."""
        return [pid for pid in self.members() if name in command_line(pid)]

    def stop(self) -> None:
        for pid in self.members():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(30)
        shutil.rmtree(self.temp, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def refusal(folder: str, cwd: Path, *options: str) -> str:
    """`serve` run to its end: its exit code must be 2 with one error line, which is returned."""
    done = subprocess.run([sys.executable, "-m", "posbias_export", "serve", folder, *options], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **CLUSTER_ENV})
    errors = [line for line in done.stderr.splitlines() if line.startswith("posbias-export: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def cluster():
    made = Cluster()
    yield made
    made.stop()


def test_serve_joins_a_cluster_and_leaves_it_up(cluster, tmp_path):
    source = save_tiny_folder("jina_bert", tmp_path / "jina")
    save_tokenizer(source, max_length=8192)
    ship(source, tmp_path / "jina_served", check_growth=False)
    ship(save_client_model("bloom", tmp_path / "bloom"), tmp_path / "bloom_served", check_growth=False)
    from posbias_export.serve.embedder import EmbedderEngine
    from posbias_export.serve.folder import ServedFolder

    direct = EmbedderEngine(ServedFolder.read(tmp_path / "jina_served"))
    port = free_port()
    # relative to the caller's directory, which the cluster's replicas do not share
    server = ServeProcess(Path("jina_served"), "--address", cluster.address, "--replicas", "2", "--threads", "1",
                          log=tmp_path / "serve.log", cwd=tmp_path)
    try:
        assert len(cluster.processes("ServeReplica:jina_served:model")) == 2
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=120)
        text = "To be, or not to be"
        got = client.embeddings.create(model="jina_served", input=[text]).data[0].embedding
        assert float(np.dot(got, direct.embed(direct.tokenize([text]))[0])) >= 0.99999

        other_port = refusal("bloom_served", tmp_path, "--address", cluster.address, "--port", str(port))
        assert f"--port {server.port}" in other_port, other_port
        same_route = refusal("bloom_served", tmp_path, "--address", cluster.address, "--port", str(server.port))
        assert "'jina_served' at /" in same_route, same_route
        assert server.status("/health") == 200  # the refused ones took nothing of it down
    finally:
        assert server.stop() == 0
    deadline = time.time() + 60
    while cluster.processes("ServeReplica:jina_served") and time.time() < deadline:
        time.sleep(1)
    assert not cluster.processes("ServeReplica:jina_served"), "our replicas outlived serve"
    assert cluster.processes("gcs_server") and cluster.processes("raylet"), "serve took the cluster down"


def test_a_cluster_that_cannot_be_joined_is_one_line(monkeypatch):
    import ray

    from posbias_export.errors import UsageError
    from posbias_export.serve import cluster as joining

    def refused(**_):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(UsageError, match=r"cannot join the Ray cluster at head:6379: Failed .*RAY_AUTH_MODE=token"):
        joining.join("head:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # set already: no hint to set it
    with pytest.raises(UsageError) as err:
        joining.join("head:6379")
    assert "RAY_AUTH_MODE" not in str(err.value)


def docs_manifest() -> dict:
    """The RayService manifest docs/serving.md gives, parsed."""
    import re

    import yaml

    text = (REPO / "docs" / "serving.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kind: RayService" in b]
    assert len(blocks) == 1, "docs/serving.md should hold one RayService manifest"
    return yaml.safe_load(blocks[0])


def test_the_docs_manifest_is_a_serve_config_our_builder_takes():
    """What KubeRay hands Ray Serve: the manifest's serveConfigV2 is valid under Serve's own schema,
    names our builder, and passes it only options it takes."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from posbias_export.serve import deploy

    manifest = docs_manifest()
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    for application in config.applications:
        assert application.import_path == "posbias_export.serve.deploy:app"
        assert set(application.args) <= set(deploy.OPTIONS) and "folder" in application.args


def test_the_docs_manifest_deploys_as_kuberay_deploys_it(tmp_path):
    """The manifest's serveConfigV2, its folder pointed at a served embedder, given to Ray Serve's
    own `serve run CONFIG --address` on a cluster of ours: the controller builds the application from
    the import path and args (what KubeRay's RayService does through the dashboard), and the route
    answers the `openai` client with the folder's own vectors."""
    import yaml

    from posbias_export.serve.embedder import EmbedderEngine
    from posbias_export.serve.folder import ServedFolder

    source = save_tiny_folder("jina_bert", tmp_path / "jina")
    save_tokenizer(source, max_length=8192)
    served = tmp_path / "jina_served"
    ship(source, served, check_growth=False)
    config = yaml.safe_load(docs_manifest()["spec"]["serveConfigV2"])
    (application,) = config["applications"]
    application["args"].update(folder=str(served), replicas=1, max_replicas=2, threads=1)  # a 2-core machine
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))

    cluster = Cluster()
    try:
        submitted = subprocess.run([str(Path(sys.executable).with_name("serve")), "run", str(path), "--address",
                                    cluster.address, "--non-blocking"], capture_output=True, text=True,
                                   timeout=STARTUP_S, env={**os.environ, **CLUSTER_ENV})
        assert submitted.returncode == 0, submitted.stderr[-2000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
        text, deadline, got = "To be, or not to be", time.time() + STARTUP_S, None
        while got is None:  # the controller deploys after `serve run` returns
            try:
                got = client.embeddings.create(model=served.name, input=[text]).data[0].embedding
            except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError):
                assert time.time() < deadline, "the manifest's application never answered"
                time.sleep(2)
        direct = EmbedderEngine(ServedFolder.read(served))
        assert float(np.dot(got, direct.embed(direct.tokenize([text]))[0])) >= 0.99999
        assert len(cluster.processes(f"ServeReplica:{application['name']}:model")) == 1  # replicas: 1
    finally:
        cluster.stop()
