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
    """`ray start --head` in a new session: every daemon and worker of it shares its process group.
    With `worker_nodes` (Ray's fake multi-node provider: a node type's resources, min and max count),
    its autoscaler starts worker nodes on this machine when demands have no room, as KubeRay adds pods."""

    def __init__(self, cpus: int = 4, worker_nodes: dict | None = None):
        self.port = free_port()
        self.temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        ray = Path(sys.executable).with_name("ray")
        scaling, env = [], {}
        if worker_nodes:
            scaling, env = self._autoscaling(cpus, worker_nodes)
        self.process = subprocess.Popen(
            [str(ray), "start", "--head", "--port", str(self.port), "--num-cpus", str(cpus), "--include-dashboard",
             "false", "--disable-usage-stats", "--temp-dir", self.temp, *scaling, "--block"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **CLUSTER_ENV, **env})
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.time() + STARTUP_S
        while not _listening(self.port):
            assert self.process.poll() is None and time.time() < deadline, "ray start --head failed"
            time.sleep(1)

    def _autoscaling(self, cpus: int, worker_nodes: dict) -> tuple[list[str], dict]:
        """The head's options and environment for Ray's fake multi-node autoscaler."""
        import json

        from ray._private.services import get_node_ip_address
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        types = {"ray.head.default": {"resources": {"CPU": cpus}, "node_config": {}, "max_workers": 0},
                 **{name: {"node_config": {}, **spec} for name, spec in worker_nodes.items()}}
        config = {"cluster_name": "fake", "max_workers": sum(t.get("max_workers", 0) for t in types.values()),
                  "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                               "disable_launch_config_check": True,
                               "gcs_address": f"{get_node_ip_address()}:{self.port}"},
                  "available_node_types": types, "head_node_type": "ray.head.default", "auth": {},
                  "upscaling_speed": 1.0, "idle_timeout_minutes": 5, "docker": {}, "file_mounts": {},
                  **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                                         "worker_setup_commands", "head_start_ray_commands",
                                         "worker_start_ray_commands", "cluster_synced_files", "rsync_exclude",
                                         "rsync_filter")}}
        path = Path(self.temp) / "autoscaling.json"
        path.write_text(json.dumps(config))
        env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
               "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID, "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID}
        return ["--autoscaling-config", str(path)], env

    def status(self) -> str:
        """`ray status`: the nodes by type and the CPUs reserved, as the autoscaler sees them."""
        return subprocess.run([str(Path(sys.executable).with_name("ray")), "status", "--address", self.address],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **CLUSTER_ENV}).stdout

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


@pytest.mark.slow
def test_a_replica_with_no_room_gets_a_node_as_the_docs_manifest_says(tmp_path):
    """The manifest's application on a cluster shaped as its RayService (a head of its 2 CPUs, worker
    nodes of its 4, from its minimum up to its maximum), Ray's autoscaler standing in for KubeRay's:
    each model replica reserves its `threads` (4), which the head cannot hold, so a node is started
    for each of the two, the replicas run there and the route answers with the folder's vectors.
    (Replicas that reserved nothing sat on the head, two sessions on its cores, and no node came.)"""
    import re

    import yaml

    from posbias_export.serve.embedder import EmbedderEngine
    from posbias_export.serve.folder import ServedFolder

    manifest = docs_manifest()
    spec = manifest["spec"]["rayClusterConfig"]
    (group,) = spec["workerGroupSpecs"]
    head_cpus = int(spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    node_cpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    (application,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    replicas, threads = application["args"]["replicas"], application["args"]["threads"]
    assert threads > head_cpus and threads <= node_cpus and replicas >= 2  # what this test relies on

    source = save_tiny_folder("jina_bert", tmp_path / "jina")
    save_tokenizer(source, max_length=8192)
    ship(source, tmp_path / "jina_served", check_growth=False)
    cluster = Cluster(cpus=head_cpus, worker_nodes={"cpu": {"resources": {"CPU": node_cpus, "object_store_memory": 10 ** 8},
                                                            "min_workers": group["minReplicas"],
                                                            "max_workers": replicas + 1}})
    try:
        server = ServeProcess(Path("jina_served"), "--address", cluster.address, "--replicas", str(replicas),
                              "--threads", str(threads), log=tmp_path / "serve.log", cwd=tmp_path)
        try:
            status = cluster.status()
            nodes = re.search(r"^\s*(\d+) cpu$", status, re.M)
            used = re.search(r"([\d.]+)/([\d.]+) CPU", status)
            assert nodes and int(nodes[1]) == replicas, status  # one node a replica, none beyond
            assert used and float(used[1]) == replicas * threads, status
            assert float(used[2]) == head_cpus + replicas * node_cpus, status
            assert len(cluster.processes("ServeReplica:jina_served:model")) == replicas
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=120)
            text = "To be, or not to be"
            got = client.embeddings.create(model="jina_served", input=[text]).data[0].embedding
            direct = EmbedderEngine(ServedFolder.read(tmp_path / "jina_served"))
            assert float(np.dot(got, direct.embed(direct.tokenize([text]))[0])) >= 0.99999
        finally:
            assert server.stop() == 0
    finally:
        cluster.stop()
