"""`ow ground commands`: the station's command log (docs/ground.md "Command log") printed,
filtered by time and count, as JSON, and followed across a rotation; bad input refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ground.console.command_log import parse_since
from ground.state import GroundState

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_796_468_400.0  # 2026-12-05T11:00:00Z


def _entry(t: float, command: str, code: str = "OK", **extra) -> dict:
    return {"t": t, "origin": "ow ground cancel", "pid": 7, "command": command, "code": code, "rtt_ms": 12.5, **extra}


def _logged(keys) -> GroundState:
    state = GroundState(keys.state_dir)
    state.log_command(_entry(T0, "STATUS"))
    rejected = _entry(T0 + 60, "CANCEL_TASK", "TASK_FINISHED", what="CANCEL_TASK t-abc", task_id="t-abc")
    rejected.update(by="payload", failed=False, text="task t-abc finished\x1b[2J")  # an escape sequence
    state.log_command(rejected)
    with open(state.command_log_path, "ab") as log:  # a torn line, as a writer killed mid-line leaves
        log.write(b'{"command": "PI')
    state.log_command(_entry(T0 + 120, "IMAGE_CHUNK", what="image coast-1.png", chunks=19, rtt_ms=88.0))
    return state


def test_prints_every_command_with_its_answer_and_round_trip(ow, keys):
    _logged(keys)
    result = ow("ground", "commands", "--keys", keys.root)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert len(lines) == 3, result.out
    assert lines[0].startswith("2026-12-05T11:00:00.000Z  STATUS") and lines[0].endswith(" OK")
    assert "12.5 ms" in lines[0] and "ow ground cancel" in lines[0]
    assert "CANCEL_TASK t-abc" in lines[1]
    assert lines[1].endswith("TASK_FINISHED (by payload): task t-abc finished\\x1b[2J")  # escaped, not obeyed
    assert "IMAGE_CHUNK image coast-1.png x19" in lines[2] and "88.0 ms" in lines[2]
    assert "skipped 1 damaged line(s) of the command log" in result.err


def test_since_last_and_json(ow, keys):
    _logged(keys)
    result = ow("ground", "commands", "--keys", keys.root, "--since", "2026-12-05T11:01:00Z", "--json")
    assert result.code == 0, result.err
    entries = [json.loads(line) for line in result.out.splitlines()]
    assert [e["command"] for e in entries] == ["CANCEL_TASK", "IMAGE_CHUNK"]
    assert entries[0]["text"] == "task t-abc finished\x1b[2J"  # exact in JSON
    result = ow("ground", "commands", "--keys", keys.root, "--last", "1", "--json")
    assert [json.loads(line)["command"] for line in result.out.splitlines()] == ["IMAGE_CHUNK"]
    result = ow("ground", "commands", "--keys", keys.root, "--since", "2026-12-05 11:01")
    assert len(result.out.splitlines()) == 2
    assert parse_since("2026-12-05") == T0 - 11 * 3600
    assert parse_since("90s", now=1000.0) == 910.0 and parse_since("1.5h", now=10_000.0) == 4600.0


def test_bad_input_is_refused_with_a_clear_message(ow, keys):
    _logged(keys)
    for bad in ("yesterday", "2026-13-40", "5 weeks", "-3m"):
        result = ow("ground", "commands", "--keys", keys.root, f"--since={bad}")
        assert result.code == 5, (bad, result)
        assert "--since:" in result.err and repr(bad) in result.err and result.out == ""
    result = ow("ground", "commands", "--keys", keys.root, "--last", "0")
    assert result.code == 5 and "--last must be >= 1" in result.err


def test_no_log_yet_says_so(ow, tmp_path):
    result = ow("ground", "commands", "--state-dir", tmp_path / "empty")
    assert result.code == 0 and result.out == ""
    assert "no command logged yet" in result.err


def test_follow_prints_new_commands_across_a_rotation(keys):
    state = _logged(keys)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "common.cli", "ground", "commands", "--keys", str(keys.root), "--follow", "--json"]
    # Ctrl-C's default action in the child, as in a terminal: a run started in the background of a
    # non-interactive shell passes SIGINT down ignored, and Python then installs no handler for it.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None

        def next_command() -> str:
            line = proc.stdout.readline()  # the test's timeout bounds this wait
            assert line, f"--follow ended: {proc.stderr.read() if proc.poll() is not None else ''}"
            return json.loads(line)["command"]

        assert [next_command() for _ in range(3)] == ["STATUS", "CANCEL_TASK", "IMAGE_CHUNK"]
        state.log_command(_entry(time.time(), "PING"))
        assert next_command() == "PING"
        state.log_command(_entry(time.time(), "SET_PRIORITY"))
        os.replace(state.command_log_path, state.command_log_path.with_suffix(".jsonl.1"))  # rotated
        state.log_command(_entry(time.time(), "DOWNLINK_RESULT"))
        assert [next_command(), next_command()] == ["SET_PRIORITY", "DOWNLINK_RESULT"]
        proc.send_signal(signal.SIGINT)  # Ctrl-C ends --follow with exit 0
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
