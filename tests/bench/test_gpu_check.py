"""The GPU check's CPU smoke (docs/benchmarks.md, "The GPU check"): the script a lent GPU will run
works here first -- every stage at the tiny size on CPU, the answer bitwise after a kill in every
phase and after each planner's restore, one JSON of figures."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_at_the_tiny_size(tmp_path):
    out, table = tmp_path / "gpu_check.json", tmp_path / "vla_profile.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--cpu-smoke", "--out", str(out), "--vla-profile-out", str(table)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # the smoke's nine forked runs of the tiny model, on a busy machine
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["mode"] == "cpu-smoke"
    stage = result["stages"]["256-tokens"]
    assert stage["bitwise"] and {phase for phase, _ in stage["kills"]} == {"vision", "prefill", "decode"}
    assert [row["planner"] for row in stage["plans"]] == ["chunk-first", "layer-first", "optimal"]
    assert all(row["bitwise"] for row in stage["plans"])
    assert all(any(e["event"] == "recovery_plan" for e in row["restore"]) for row in stage["plans"])
    assert stage["overhead"] is not None and stage["uninterrupted"]["bytes_written"] > 0
    vla = result["stages"]["vla"]
    assert vla["backend"] == "cpu" and vla["table"] == str(table) and vla["lockstep_rows"] == 1
    # the measured lockstep table (docs/vla.md), valid as the loader checks it
    from common.vla.profiles import load_profile

    measured = load_profile(table)
    assert measured.backend == "cpu" and measured.provenance["tool"] == "bench/gpu_check.py"
    assert measured.lockstep("smolvla", 1, "smolvla", 1).lockstep_ms > 0
