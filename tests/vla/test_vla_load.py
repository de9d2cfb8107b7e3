"""`ow vla load` drives a real `ow vla serve` process: robot keys, the plan's routing, warm-up first.

The server is started beyond loopback (0.0.0.0, reached here only through 127.0.0.1) with a
shared robot token and a two-GPU plan (pi0 on GPU 0, SmolVLA on GPU 1); the load generator runs as
robots would, over websockets in the openpi wire format with emulated WiFi delays. The SLO is set
far above this shared CPU's latency: these tests check what is served and reported, never speed.
"""

import json
import os
import subprocess
import sys

import pytest
from openpi_venv import REPO

from common.vla.server import load_keys, robot_for_key

pytestmark = pytest.mark.xdist_group("vla-load")  # one server for the module's tests
TOKEN = "load-test-shared-token-42"
PLAN = {
    "format": "orbitweaver.vla.plan/1",
    "gpus": [{"gpu": 0, "robots": {"pi0": 2}}, {"gpu": 1, "robots": {"smolvla": 1}}],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "plan.json").write_text(json.dumps(PLAN))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "common.cli",
            "vla",
            "serve",
            "--plan",
            str(tmp / "plan.json"),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--token",
            TOKEN,
            "--slo-ms",
            "20000",
            "--threads",
            "2",
            "--batch-sizes",
            "1,2",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        line = proc.stdout.readline()
        if not line.startswith("serving ws://0.0.0.0:"):
            proc.kill()
            raise AssertionError(f"server did not start: {first!r} {line!r} {proc.stderr.read()[-2000:]}")
        assert first.startswith("warming up 2 engine(s)")  # warm-up happens before robots are accepted
        yield {"url": "ws://127.0.0.1:" + line.split()[1].rsplit(":", 1)[1], "proc": proc, "tmp": tmp}
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert "refused=1" in out  # the keyless robot below


def _load(server, *extra):
    out = server["tmp"] / f"load{len(extra)}.json"
    run = subprocess.run(
        [sys.executable, "-m", "common.cli", "vla", "load", "--url", server["url"], "--json", str(out), *extra],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run, json.loads(out.read_text())


def test_load_generator_reports_per_model_over_the_real_endpoint(server):
    run, report = _load(server, "--robots", "pi0=2,smolvla=1", "--duration", "3", "--token", TOKEN)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "worst model attainment" in run.stdout
    models = report["models"]
    assert set(models) == {"pi0", "smolvla"}
    for name, m in models.items():
        assert m["requests"] > 0 and m["answered"] == m["requests"] and m["errors"] == 0, (name, m)
        assert m["slo_ms"] == 20000.0 and 0 < m["p50_ms"] <= m["p99_ms"] < 20000
        assert m["attainment"] == 1.0
    assert set(models["pi0"]["gpus"]) == {"0"} and set(models["smolvla"]["gpus"]) == {"1"}  # the plan's routing


def test_robots_without_a_known_key_are_refused_clearly(server):
    from common.vla.load import run_load

    report = run_load(server["url"], {"pi0": 1}, duration_s=2.0, network=None)
    m = report.models["pi0"]
    assert m.requests > 0 and m.answered == 0 and report.worst_attainment == 0.0
    assert "HTTP 401" in m.errors[0]


def test_key_file_and_header_check(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# robots of line 3\narm-1 0123456789abcdef0123\narm-2 fedcba9876543210fedc  # spare\n")
    keys = load_keys(str(path))
    assert robot_for_key(keys, "Api-Key fedcba9876543210fedc") == ("arm-2", None)
    assert robot_for_key(keys, "Api-Key wrong")[1] == "unknown robot key"
    assert "Api-Key" in robot_for_key(keys, None)[1]
    assert robot_for_key(None, None) == (None, None)
    path.write_text("arm-1 short\n")
    with pytest.raises(ValueError, match="shorter than 16"):
        load_keys(str(path))
