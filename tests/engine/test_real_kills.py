"""Real power cuts: `ow infer` runs as its own OS process and is SIGKILLed at random instants
spread over vision, prefill and decode, again and again on the same checkpoint directory. The
final answer equals the uninterrupted one, token for token and logit bit for logit bit."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

UNIT_EVENTS = {"vision_block_done": "vision", "prefill_block_done": "prefill", "decode_step_done": "decode"}


def _command(model_dir, images, ckpt, pace_ms, policy="orbitweaver"):
    cmd = [sys.executable, "-m", "common.cli", "infer", "--model", model_dir, "--policy", policy, "--prompt",
           "describe the clouds over the coast and count the ships in the harbor , then compare the two images",
           "--max-new-tokens", "12", "--ckpt-dir", ckpt, "--chunk", "16", "--group", "2", "--decode-every", "2",
           "--vision-every", "1", "--threads", "1", "--json", "--log-level", "debug", "--pace-ms", str(pace_ms)]
    for im in images:
        cmd += ["--image", im]
    return cmd


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _finish(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _run_and_kill(cmd, rng, pace_ms):
    """Start the process, wait for its first unit of work, SIGKILL it a random instant later.
    Returns (phase of the last unit seen before the kill, or None if it finished first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    last_phase = None
    deadline = time.monotonic() + 120
    delay = rng.uniform(0, 4 * pace_ms / 1000)
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        try:
            event = json.loads(line).get("event")
        except json.JSONDecodeError:
            continue
        if event in UNIT_EVENTS:
            last_phase = UNIT_EVENTS[event]
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return last_phase, None
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    return None, json.loads(out)


@pytest.mark.slow
@pytest.mark.parametrize("policy,min_kills,min_per_phase", [
    ("orbitweaver", 20, 2), ("sonic-layer", 6, 1), ("sonic-chunk", 6, 1), ("hcache", 6, 1)])
def test_sigkill_at_random_instants_across_all_phases(model_dirs, image_files, tmp_path, policy, min_kills,
                                                      min_per_phase):
    """orbitweaver gets the full 20+ kills; each baseline gets a shorter run of the same test."""
    pace_ms = 25
    rng = np.random.default_rng(11)
    reference = _finish(_command(model_dirs["qwen3-vl"], image_files, str(tmp_path / "ref"), 0, policy))
    assert reference["resumed"] is False
    kills, phases = 0, {"vision": 0, "prefill": 0, "decode": 0}
    request = 0
    while kills < min_kills:
        request += 1
        cmd = _command(model_dirs["qwen3-vl"], image_files, str(tmp_path / f"req{request}"), pace_ms, policy)
        for _ in range(40):
            phase, result = _run_and_kill(cmd, rng, pace_ms)
            if result is not None:
                break
            kills += 1
            phases[phase] += 1
        else:
            pytest.fail("the request made no progress across 40 kills")
        assert result["token_ids"] == reference["token_ids"]
        assert result["logits_sha256"] == reference["logits_sha256"]
        assert result["resumed"] is True
        assert request < 6
    assert kills >= min_kills
    assert all(n >= min_per_phase for n in phases.values()), phases
