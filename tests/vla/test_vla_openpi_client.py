"""Acceptance: `ow vla serve` answers the published openpi-client's WebsocketClientPolicy.

openpi-client pins numpy<2 (this project uses numpy 2), so it gets its own virtual
environment, built once from the package registry and cached in `.venv-openpi/` at the
repository root (override with OW_OPENPI_VENV); the registry is reached only to build it. The
client runs there, the server is a real `ow vla serve` process here, and they talk over 127.0.0.1.
"""

import json
import os
import subprocess
import sys

import pytest
from openpi_venv import REPO, openpi_python

CLIENT = r"""
import json, sys
import numpy as np
from openpi_client import image_tools
from openpi_client.websocket_client_policy import WebsocketClientPolicy

port = int(sys.argv[1])
rng = np.random.default_rng(0)
def frame():
    raw = rng.integers(0, 256, (256, 320, 3), dtype=np.uint8)
    return image_tools.convert_to_uint8(image_tools.resize_with_pad(raw, 224, 224))
obs = {"observation/image": frame(), "observation/wrist_image": frame(),
       "observation/state": rng.standard_normal(8), "prompt": "put the black bowl on the plate"}
out = {"numpy": np.__version__}
policy = WebsocketClientPolicy(host="127.0.0.1", port=port)
out["metadata"] = policy.get_server_metadata()
first = policy.infer(obs)
out["actions"] = [list(first["actions"].shape), str(first["actions"].dtype)]
out["server_timing"] = first["server_timing"]
try:
    policy.infer({"prompt": "no images"})
    out["error"] = None
except RuntimeError as exc:
    out["error"] = str(exc)
out["after_error"] = list(policy.infer(obs)["actions"].shape)
other = WebsocketClientPolicy(host=f"ws://127.0.0.1:{port}/smolvla")
out["other_model"] = other.get_server_metadata()["model"]
out["other_actions"] = list(other.infer(obs)["actions"].shape)
print(json.dumps(out))
"""


@pytest.fixture
def served_port():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "common.cli",
            "vla",
            "serve",
            "--port",
            "0",
            "--models",
            "pi0,smolvla",
            "--slo-ms",
            "2000",
            "--threads",
            "2",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if line.startswith("warming up"):  # the server warms up before it accepts robots
            line = proc.stdout.readline()
        if not line.startswith("serving ws://127.0.0.1:"):
            proc.kill()
            raise AssertionError(f"server did not start: {line!r} {proc.stderr.read()[-2000:]}")
        yield int(line.split()[1].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        assert proc.returncode == 0, err[-2000:]
        assert "stopped: served=" in out


def test_openpi_websocket_client_policy_talks_to_ow_vla_serve(served_port, tmp_path):
    py = openpi_python()
    script = tmp_path / "robot.py"
    script.write_text(CLIENT)
    # a hang guard only: how long the client's venv takes to import is the machine's business
    run = subprocess.run([str(py), str(script), str(served_port)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["numpy"].startswith("1.")  # the client's own pins, not ours
    assert out["metadata"]["model"] == "pi0" and out["metadata"]["action_horizon"] == 50
    assert out["actions"] == [[50, 7], "float32"]
    assert out["server_timing"]["infer_ms"] > 0
    assert out["error"] is not None and "missing" in out["error"]  # openpi raises the server's text reply
    assert out["after_error"] == [50, 7]  # the same connection keeps working
    assert out["other_model"] == "smolvla" and out["other_actions"] == [50, 7]
