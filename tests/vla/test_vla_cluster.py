"""Acceptance: the plan served from a real two-node Ray cluster on this machine, through Ray Serve.

Two `ray start` nodes (head and worker, each with its own temp dir, ports and loopback address), each
offering two stand-in GPU slots (`vla_gpu`). `ow vla cluster` deploys a two-GPU plan (pi0 on one
GPU, SmolVLA on the other). The published openpi client (its own venv) then asks both models with
a robot key: both nodes answer, and every action chunk equals the one the model computes here for
the same observation. Then the worker node is killed (SIGKILL to its whole process tree): its
model comes back on the head node, served again with the right answers; a robot with a wrong key
is refused. No timed asserts: every wait is a hang guard with a generous limit.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
import pytest
from openpi_venv import REPO, openpi_python
from raykit import await_node, kill_tree, wait_listening
from testkit import free_ports

pytest.importorskip("ray.serve", reason="Ray Serve is in the test extra; `make venv` installs it")

# One worker runs every test that starts a Ray cluster (make test runs --dist loadgroup): two
# clusters at once would share this machine's cores and loopback (tests/hil/test_farm.py).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray-cluster")]
TOKEN = "cluster-test-robot-key-0001"
# Each node its own loopback address: Ray turns 127.0.0.1 into the machine's routable address,
# and every packet of this test stays on loopback.
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "5",
    "OMP_NUM_THREADS": "1",
    "RAY_DEDUP_LOGS": "0",
}

CLIENT = r"""
import json, sys, time, zlib
import numpy as np
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

port, key, out, seed = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = np.random.default_rng(seed)
records, arrays = [], {}
deadline = time.time() + 240  # hang guard: a model whose server is coming back gets retried until then
for model in ("pi0", "smolvla"):
    policy = WebsocketClientPolicy(host=f"ws://127.0.0.1:{port}/{model}", api_key=key)
    for i in range(3):
        obs = {"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
               "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
               "observation/state": rng.standard_normal(8), "prompt": f"pick up the {model} block {i}"}
        errors = []
        while True:
            try:
                reply = policy.infer(obs)
                break
            except Exception as exc:  # an error frame (RuntimeError) or a dropped connection
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                if time.time() > deadline:
                    raise
                time.sleep(2)
                policy = WebsocketClientPolicy(host=f"ws://127.0.0.1:{port}/{model}", api_key=key)
        n = len(records)
        arrays.update({f"image{n}": obs["observation/image"], f"wrist{n}": obs["observation/wrist_image"],
                       f"state{n}": obs["observation/state"], f"actions{n}": reply["actions"]})
        records.append({"model": model, "reply_model": reply["model"], "node": reply["node"], "gpu": reply["gpu"],
                        "prompt": obs["prompt"], "seed": zlib.crc32(msgpack_numpy.Packer().pack(obs)),
                        "errors_before": errors})
np.savez(out + ".npz", **arrays)
try:
    WebsocketClientPolicy(host=f"ws://127.0.0.1:{port}/pi0", api_key="not-a-known-key-at-all")
    refused = None
except Exception as exc:
    refused = f"{type(exc).__name__}: {exc}"
json.dump({"records": records, "refused": refused}, open(out + ".json", "w"))
"""


def _ray_node(tmp, short, name, ip, resources, *, head_port=None, gcs=None):
    """A `ray start --block` node in its own session; returns the process (its tree is the node).
    Its temp dir is under a short path: Ray's unix socket paths must stay under 108 bytes."""
    # Every port in one pick (free_ports holds them all at once, so they differ), the head's own
    # port left out: two picks could hand one port to two of Ray's components, and Ray refuses to start.
    ports = [port for port in free_ports(9) if port != head_port][:8]
    nm, om, agent_grpc, agent_http, metrics, rt_env, client_port, dash = ports
    args = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--block",
        "--disable-usage-stats",
        f"--node-ip-address={ip}",
        "--num-cpus=2",
        f"--resources={json.dumps(resources)}",
        f"--temp-dir={short}/{name}",
        f"--node-manager-port={nm}",
        f"--object-manager-port={om}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={rt_env}",
    ]
    if head_port:
        args += [
            "--head",
            f"--port={head_port}",
            "--include-dashboard=false",
            f"--ray-client-server-port={client_port}",
            f"--dashboard-port={dash}",
        ]
    else:
        args += [f"--address={gcs}"]
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(
        args, cwd=REPO, env={**os.environ, **RAY_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_for(path, text, proc, limit_s):
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert proc.poll() is None, f"{path.name} exited early:\n{path.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} in {path.name} after {limit_s} s (hang guard):\n{path.read_text()[-3000:]}")


def _expected_actions(model, record, arrays, n):
    from common.vla.config import MODELS
    from common.vla.models import Observation, VlaPolicy

    policy = _policies.setdefault(model, VlaPolicy(MODELS[model]))
    obs = Observation(
        [arrays[f"image{n}"], arrays[f"wrist{n}"]],
        arrays[f"state{n}"].astype(np.float32),
        record["prompt"],
        record["seed"],
    )
    return policy.infer(obs)


_policies = {}


def _ask(py, port, tmp, tag, seed):
    out = tmp / tag
    run = subprocess.run(
        [str(py), str(tmp / "robot.py"), str(port), TOKEN, str(out), str(seed)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((tmp / f"{tag}.json").read_text())
    arrays = np.load(tmp / f"{tag}.npz")
    for n, rec in enumerate(doc["records"]):  # nothing answers wrong: each chunk is the model's own
        assert rec["reply_model"] == rec["model"]
        np.testing.assert_allclose(arrays[f"actions{n}"], _expected_actions(rec["model"], rec, arrays, n), atol=1e-4)
    return doc


def test_plan_served_by_two_ray_nodes_survives_losing_one(tmp_path):
    t0 = time.time()

    def phase(name):
        print(f"[{time.time() - t0:6.1f} s] {name}", flush=True)

    py = openpi_python()
    (tmp_path / "robot.py").write_text(CLIENT)
    gcs_port, serve_port = free_ports(2)
    short = tempfile.mkdtemp(prefix="owray-", dir="/tmp")
    head = worker = cluster = None
    try:

        def start_head():
            return _ray_node(tmp_path, short, "head", HEAD_IP, {"vla_gpu": 2, "vla_head": 1}, head_port=gcs_port)

        def start_worker():
            return _ray_node(tmp_path, short, "worker", WORKER_IP, {"vla_gpu": 2}, gcs=f"{HEAD_IP}:{gcs_port}")

        head = start_head()
        wait_listening(HEAD_IP, gcs_port, head)  # the worker starts as soon as the head's GCS listens
        worker = start_worker()
        head = await_node(tmp_path, "head", head, start_head)
        worker = await_node(tmp_path, "worker", worker, start_worker)
        phase("two nodes up")
        plan = {
            "format": "orbitweaver.vla.plan/1",
            "profile": "test",
            "placement": "pi0:0;smolvla:1",
            "n_gpus": 2,
            "robots": {"pi0": 2, "smolvla": 2},
            "gpus": [{"gpu": 0, "robots": {"pi0": 2}}, {"gpu": 1, "robots": {"smolvla": 2}}],
        }
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        log = open(tmp_path / "cluster.log", "w")
        cluster = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "common.cli",
                "vla",
                "cluster",
                "--address",
                f"{HEAD_IP}:{gcs_port}",
                "--node-ip-address",
                HEAD_IP,
                "--plan",
                str(tmp_path / "plan.json"),
                "--port",
                str(serve_port),
                "--token",
                TOKEN,
                "--gpu-resource",
                "vla_gpu",
                "--gateway-resource",
                "vla_head",
                "--proxy-location",
                "head",
                "--slo-ms",
                "5000",
                "--batch-sizes",
                "1",
                "--max-batch",
                "1",
                "--watch-interval",
                "2",
                "--no-warm-up",
            ],
            cwd=REPO,
            env={**os.environ, **RAY_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _wait_for(tmp_path / "cluster.log", "serving ws://127.0.0.1", cluster, 400)
        phase("plan deployed")

        before = _ask(py, serve_port, tmp_path, "before", 1)
        phase("both models answered")
        nodes = {r["model"]: r["node"] for r in before["records"]}
        assert len(set(nodes.values())) == 2, f"both nodes serve: {nodes}"
        assert before["refused"] and ("401" in before["refused"] or "403" in before["refused"]), before["refused"]
        # Which model runs on the worker node: its replica's pid is in the worker's process tree.
        worker_pids = {c.pid for c in psutil.Process(worker.pid).children(recursive=True)}
        on_worker = [m for m, pid in _replica_pids(tmp_path).items() if pid in worker_pids]
        assert len(on_worker) == 1, (on_worker, (tmp_path / "cluster.log").read_text()[-2000:])
        head_node = next(node for m, node in nodes.items() if m not in on_worker)

        kill_tree(worker)
        worker = None
        after = _ask(py, serve_port, tmp_path, "after", 2)  # retries while the lost GPU comes back
        phase("answered again after the worker node was killed")
        assert {r["model"] for r in after["records"]} == {"pi0", "smolvla"}
        assert {r["node"] for r in after["records"]} == {head_node}, "the lost model came back on the head node"
    finally:
        if cluster is not None and cluster.poll() is None:
            cluster.kill()  # the whole cluster goes next: no graceful application delete needed
            cluster.wait(timeout=60)
        for proc in (worker, head):
            if proc is not None:
                kill_tree(proc)
        shutil.rmtree(short, ignore_errors=True)


def _replica_pids(tmp_path):
    """model -> pid of its GPU replica, from `ow vla cluster`'s placement lines (latest wins)."""
    out = {}
    for line in (tmp_path / "cluster.log").read_text().splitlines():
        if line.startswith("gpu") and " on node " in line and " pid " in line:
            models = line.split(":", 1)[1].split(" on node ")[0].strip()
            for m in models.split(","):
                out[m] = int(line.rsplit(" pid ", 1)[1])
    return out
