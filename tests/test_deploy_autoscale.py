"""Real autoscaling runs: cluster/aws-gpu.yaml adapted to Ray's fake multi-node provider, started with
``ray start --head --autoscaling-config`` on this machine. The head has no CPU for a rank, so the
autoscaler must launch worker nodes of the YAML's types for every job, and once it is done, give the
idle nodes back. Nothing of the cluster is left running afterwards: no process, no placement group.

- examples/train_gpt.py asks for 2 workers, and trains on the nodes launched for it.
- An elastic job (tests/jobs/autoscale_job.py, 1 to 3 workers) runs on the one node the cluster may have,
  grows when the cluster's max_workers is raised and a second node arrives, and goes on at 1 rank
  when the test terminates the node under one of its ranks (SIGKILL of that node's raylet). (One node and
  then two show the same as two and then three, with a node and a rank process fewer to start.)

The jobs are submitted with ``ray job submit`` and this checkout as the working_dir, given as
``local://`` because every fake node shares this machine's disk (an uploaded working_dir would be
unpacked by each node's runtime-env agent into the one shared session directory, with overwrite: a
node that joins later deletes the files under the running ranks of the others).

The cluster runs in its own temp dir (so other Ray users of this machine never take it for "the"
local cluster), on free ports, and its processes are known by a marker in their environment or by
their files under that temp dir: the teardown ends exactly those (never ``ray stop``, which would end
every Ray cluster of the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.support.deploy import MARKER, cluster_processes, end_processes

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "cluster" / "aws-gpu.yaml"
HEAD_TYPE = "ray.head.default"  # the fake provider's fixed name for the head's type
MAX_FAKE_WORKERS = 2  # per worker type: enough for the job, few processes on a 2-core machine
IDLE_TIMEOUT_MINUTES = 0.1  # the YAML's 10 minutes, shortened so the test sees idle nodes given back
# The YAML's health check (about 30 s to declare a node dead) suits a cloud; here a terminated node is noticed
# in about 2 s, as in Ray's own autoscaler tests.
FAST_HEALTH_CHECK = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
                     "RAY_health_check_failure_threshold": "4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_env(config: dict) -> dict[str, str]:
    """The RAY_* assignments in front of the YAML's ``ray start --head``: the head runs with them here too."""
    start = next(c for c in config["head_start_ray_commands"] if "ray start" in c)
    return dict(w.split("=", 1) for w in start.split() if w.startswith("RAY_") and "=" in w)


def fake_multinode_config(source: dict, gcs_address: str) -> dict:
    """``source`` with its provider replaced by fake_multinode and each worker type by a 1-CPU fake node.

    Node type names, the head's resources, min_workers and upscaling_speed stay the YAML's; what
    the fake provider cannot do (SSH, setup commands, docker, file mounts) is emptied, as in Ray's
    own fake multi-node example config.
    """
    types = {}
    for name, node_type in source["available_node_types"].items():
        if name == source["head_node_type"]:
            types[HEAD_TYPE] = {"resources": dict(node_type["resources"]), "node_config": {}, "max_workers": 0}
        else:
            types[name] = {
                "resources": {"CPU": 1, "object_store_memory": 150 * 2**20},
                "node_config": {},
                "min_workers": node_type.get("min_workers", 0),
                "max_workers": min(node_type["max_workers"], MAX_FAKE_WORKERS),
            }
    return {
        "cluster_name": source["cluster_name"],
        "max_workers": sum(t.get("max_workers", 0) for t in types.values()),
        "upscaling_speed": source["upscaling_speed"],
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,  # a request for n nodes starts n (one at a time by default)
        },
        "auth": {},
        "docker": {},
        "available_node_types": types,
        "head_node_type": HEAD_TYPE,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class FakeCluster:
    def __init__(self, token: str, temp_dir: str, gcs_address: str, dashboard_url: str, env: dict[str, str],
                 config_path: Path):
        self.token, self.temp_dir, self.gcs_address, self.dashboard_url, self.env = (
            token, temp_dir, gcs_address, dashboard_url, env)
        self.config_path = config_path

    def set_max_workers(self, n: int) -> None:
        """Change the cluster's max_workers, as an operator would: the autoscaler reads its YAML again at
        every update (written whole, then renamed, so it never reads half a file)."""
        config = yaml.safe_load(self.config_path.read_text())
        config["max_workers"] = n
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        os.replace(tmp, self.config_path)

    def wait_for_dashboard(self, timeout_s: float) -> None:
        """``ray start`` returns before the dashboard (the state API's server) answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.nodes()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def nodes(self) -> list:
        from ray.util.state import list_nodes

        return list_nodes(address=self.dashboard_url, limit=1000, raise_on_missing_output=False)

    def rank_nodes(self) -> list[str]:
        """Node ids of the live rank actors."""
        from ray.util.state import list_actors

        actors = list_actors(address=self.dashboard_url, filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")],
                             limit=1000, raise_on_missing_output=False)
        return [a.node_id for a in actors]

    def terminate_node(self, node_id: str) -> None:
        """SIGKILL the node's raylet, as a machine that vanishes (the fake provider names each node's
        processes by the node id in their environment)."""
        raylets = []
        for proc in psutil.process_iter(["name"]):
            try:
                if "raylet" in proc.info["name"] and proc.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id:
                    raylets.append(proc)
            except psutil.Error:
                continue
        assert len(raylets) == 1, f"raylet of node {node_id}: {raylets}"
        raylets[0].kill()

    def placement_groups(self) -> list:
        from ray.util.state import list_placement_groups

        return list_placement_groups(address=self.dashboard_url, limit=1000, raise_on_missing_output=False)


@pytest.fixture
def fake_cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    source = yaml.safe_load(SOURCE.read_text())
    port, dashboard_port = _free_port(), _free_port()
    gcs_address = f"127.0.0.1:{port}"
    config_path = tmp_path / "fake-aws-gpu.yaml"
    config_path.write_text(yaml.safe_dump(fake_multinode_config(source, gcs_address)))
    token = uuid.uuid4().hex
    temp_dir = tempfile.mkdtemp(prefix="zrfake", dir="/tmp")  # short: Ray's socket paths live under it
    head = source["available_node_types"][source["head_node_type"]]["resources"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(_head_env(source))
    env.update(FAST_HEALTH_CHECK)
    env.update({
        MARKER: token,
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",  # loopback only; the state API calls of this test carry no token
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    })
    cmd = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
        f"--port={port}", f"--autoscaling-config={config_path}", f"--temp-dir={temp_dir}",
        f"--num-cpus={head.get('CPU', 0):g}", "--num-gpus=0",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
        f"--metrics-export-port={_free_port()}", "--object-store-memory", str(150 * 2**20),
        "--disable-usage-stats",
    ]
    try:
        for attempt in range(3):  # Ray gives a starting raylet 30 s to register: not enough on a loaded machine
            started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            if started.returncode == 0 or "timed out during startup" not in started.stderr or attempt == 2:
                break
            end_processes(token, temp_dir)
        assert started.returncode == 0, f"ray start failed: {started.stdout[-2000:]}{started.stderr[-2000:]}"
        cluster = FakeCluster(token, temp_dir, gcs_address, f"http://127.0.0.1:{dashboard_port}", env, config_path)
        cluster.wait_for_dashboard(timeout_s=60.0)
        yield cluster
    finally:
        end_processes(token, temp_dir, grace_s=3.0)
        left = cluster_processes(token, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the fake cluster left running: {[(p.pid, p.name()) for p in left]}"


def _submit(cluster: FakeCluster, *entrypoint: str) -> list[str]:
    return [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", cluster.dashboard_url,
            "--working-dir", f"local://{ROOT}", "--", sys.executable, *entrypoint]


def _wait_until_idle_nodes_are_given_back(cluster: FakeCluster) -> None:
    deadline = time.monotonic() + 90.0
    while [n for n in cluster.nodes() if n.state == "ALIVE" and not n.is_head_node]:
        assert time.monotonic() < deadline, "idle worker nodes were not terminated"
        time.sleep(1.0)
    log = (Path(cluster.temp_dir) / "session_latest" / "logs" / "monitor.log").read_text()
    assert re.search(r":event_summary:Removing \d+ nodes of type ray\.worker\.gpu(\.spot)? \(idle\)", log), log[-3000:]
    left = [(p.name, p.state) for p in cluster.placement_groups() if p.state != "REMOVED"]
    assert not left, left


# The elastic test below also starts from no worker node, trains, and sees the idle nodes given back; this one
# runs docs/deploy.md's exact command (the example). Out of the default suite to keep it under 20 minutes.
@pytest.mark.slow
@pytest.mark.timeout(420)  # bounds for a busy machine; about 60 s here
def test_autoscaler_launches_workers_for_a_zeroray_job_and_it_trains(fake_cluster: FakeCluster,
                                                                      tmp_path: Path) -> None:
    assert [n.is_head_node for n in fake_cluster.nodes() if n.state == "ALIVE"] == [True]

    # Submitted as docs/deploy.md says (the working_dir as local://, see the module's docstring).
    cmd = _submit(fake_cluster, "examples/train_gpt.py", "--workers", "2", "--steps", "4",
                  "--storage-path", str(tmp_path / "runs"), "--name", "autoscaled",
                  "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block", "32")
    done = subprocess.run(cmd, cwd=tmp_path, env=fake_cluster.env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "waiting for the autoscaler to add nodes" in out
    assert "at step 4" in out and "2 ranks" in out
    assert (tmp_path / "runs" / "autoscaled" / "checkpoint_4" / "manifest.json").exists()

    # The ranks ran on nodes the autoscaler launched (the head holds no CPU for a rank); by now they
    # may be idle and given back already.
    workers = [n for n in fake_cluster.nodes() if not n.is_head_node]
    assert len(workers) >= 2, workers
    log = (Path(fake_cluster.temp_dir) / "session_latest" / "logs" / "monitor.log").read_text()
    added = re.findall(r":event_summary:Adding (\d+) node\(s\) of type (\S+)\.", log)
    assert sum(int(n) for n, _ in added) >= 2, log[-3000:]
    assert {t for _, t in added} <= {"ray.worker.gpu", "ray.worker.gpu.spot"}, added
    history = [json.loads(line) for line in (tmp_path / "runs" / "autoscaled" / "metrics.jsonl").read_text().splitlines()]
    assert [h["_global_step"] for h in history if "loss" in h] == [1, 2, 3, 4]
    # The job is done: the autoscaler gives the idle worker nodes back (min_workers is 0).
    _wait_until_idle_nodes_are_given_back(fake_cluster)


def _worlds(history: Path) -> list[int]:
    """The world size of every step reported so far (complete lines only: the file is being appended to)."""
    text = history.read_text() if history.exists() else ""
    lines = text.splitlines()[: text.count("\n")]
    return [json.loads(line)["world"] for line in lines if '"world"' in line]


def _wait_for(what: str, condition: Callable[[], bool], job: subprocess.Popen, cluster: FakeCluster,
              timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {job.stdout.read()[-6000:]}")
        if time.monotonic() > deadline:
            log = (Path(cluster.temp_dir) / "session_latest" / "logs" / "monitor.log").read_text()
            raise AssertionError(f"no {what} within {timeout_s:.0f}s; the autoscaler's log ends: {log[-4000:]}")
        time.sleep(0.5)


@pytest.mark.timeout(600)  # bounds for a busy machine
def test_an_elastic_job_grows_as_nodes_arrive_and_shrinks_when_one_is_terminated(fake_cluster: FakeCluster,
                                                                                tmp_path: Path) -> None:
    stop, history = tmp_path / "stop", tmp_path / "runs" / "elastic" / "metrics.jsonl"
    fake_cluster.set_max_workers(1)
    job = subprocess.Popen(_submit(fake_cluster, "tests/jobs/autoscale_job.py", str(tmp_path / "runs"), str(stop)),
                           cwd=tmp_path, env=fake_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The job asks the autoscaler for room for 3 workers; the cluster may have 1 worker node.
        _wait_for("group of 1 rank", lambda: 1 in _worlds(history), job, fake_cluster, 300)
        fake_cluster.set_max_workers(2)  # a second node arrives, and the group grows to it
        _wait_for("group of 2 ranks", lambda: 2 in _worlds(history), job, fake_cluster, 300)
        victim = fake_cluster.rank_nodes()[0]
        fake_cluster.terminate_node(victim)
        killed_at = len(_worlds(history))
        _wait_for("smaller group after the node was terminated", lambda: any(w < 2 for w in _worlds(history)[killed_at:]),
                  job, fake_cluster, 180)
        stop.touch()
        out, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-6000:]
    assert re.search(r"finished at step \d+ on [12] ranks", out), out[-3000:]  # 2 if the node was replaced by then
    attempts = json.loads((tmp_path / "runs" / "elastic" / "run.json").read_text())["attempt_history"]
    grown = [a for a in attempts if a["end"] == "resize_up" and a["world_size"] == 1]
    assert grown and attempts[attempts.index(grown[0]) + 1]["world_size"] == 2, attempts
    failed = [a for a in attempts if a["end"] == "failure"]
    assert len(failed) == 1 and failed[0]["world_size"] == 2 and failed[0]["node"] == victim, attempts
    assert attempts[attempts.index(failed[0]) + 1]["world_size"] == 1, attempts  # went on without the lost node
    assert attempts[-1]["end"] == "finished", attempts
    _wait_until_idle_nodes_are_given_back(fake_cluster)
