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
    cmd = [
        sys.executable,
        "-m",
        "common.cli",
        "infer",
        "--model",
        model_dir,
        "--policy",
        policy,
        "--prompt",
        "describe the clouds over the coast and count the ships in the harbor , then compare the two images",
        "--max-new-tokens",
        "12",
        "--ckpt-dir",
        ckpt,
        "--chunk",
        "16",
        "--group",
        "2",
        "--decode-every",
        "2",
        "--vision-every",
        "1",
        "--threads",
        "1",
        "--json",
        "--log-level",
        "debug",
        "--pace-ms",
        str(pace_ms),
    ]
    for im in images:
        cmd += ["--image", im]
    return cmd


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _finish(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _run_and_kill(cmd, rng, pace_ms, after_commit=False):
    """Start the process, wait for its first unit of work (with `after_commit`: for its first
    durable checkpoint), SIGKILL it a random instant later. Returns (phase of the last unit seen
    before the kill, whether a checkpoint was committed before it), or (None, result) if the
    process finished first. A loaded machine can make a background commit slower than the random
    delay again and again; the caller then asks for `after_commit`, so every request still makes
    progress whatever this machine's speed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    last_phase, committed = None, False
    deadline = time.monotonic() + 120
    delay = rng.uniform(0, 12 * pace_ms / 1000)  # up to 12 units of work: a few runs per request
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        try:
            event = json.loads(line).get("event")
        except json.JSONDecodeError:
            continue
        committed = committed or event == "checkpoint_committed"
        last_phase = UNIT_EVENTS.get(event, last_phase)
        if event in UNIT_EVENTS and (committed or not after_commit):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return last_phase, committed
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return None, json.loads(out)


@pytest.mark.slow
@pytest.mark.parametrize("policy,min_kills,min_per_phase", [("orbitweaver", 8, 2), ("hcache", 3, 1)])
def test_sigkill_at_random_instants_across_all_phases(
    model_dirs, image_files, tmp_path, policy, min_kills, min_per_phase
):
    """orbitweaver gets 8+ kills, at least two in every phase; HCache, whose commits are off the
    compute path as ours are, a shorter run (one kill in every phase at least). The SONIC
    baselines commit synchronously: test_exhaustive_stops stops them after every unit and every
    commit. bench/redteam.py cuts the payload a thousand times."""
    pace_ms = 25
    rng = np.random.default_rng(11)
    reference = _finish(_command(model_dirs["qwen3-vl"], image_files, str(tmp_path / "ref"), 0, policy))
    assert reference["resumed"] is False
    kills, phases = 0, {"vision": 0, "prefill": 0, "decode": 0}
    request = 0
    while kills < min_kills or min(phases.values()) < min_per_phase:
        request += 1
        assert request <= 6, (kills, phases)
        cmd = _command(model_dirs["qwen3-vl"], image_files, str(tmp_path / f"req{request}"), pace_ms, policy)
        after_commit = False
        request_kills = 0
        for _ in range(40):
            phase, outcome = _run_and_kill(cmd, rng, pace_ms, after_commit)
            if phase is None:
                result = outcome
                break
            kills += 1
            request_kills += 1
            phases[phase] += 1
            after_commit = not outcome  # nothing durable this time: the next kill waits for a commit
        else:
            pytest.fail("the request made no progress across 40 kills")
        assert result["token_ids"] == reference["token_ids"]
        assert result["logits_sha256"] == reference["logits_sha256"]
        assert result["resumed"] is True
        # each kill came after the MANIFEST was durable: every boot after it was a restart, kept
        # once (one that found the RESULT already there, a kill after it was durable, too)
        assert [entry["restart"] for entry in result["recoveries"]] == list(range(1, request_kills + 1))
        assert result["lifetime_bytes_written"] >= reference["lifetime_bytes_written"]
    assert kills >= min_kills
    assert all(n >= min_per_phase for n in phases.values()), phases
