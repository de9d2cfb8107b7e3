"""The README's hand-run section is `hil/handrun.py`'s block, and that script runs: the same
commands, three terminals' worth, on the demo trace with the tiny model, with real processes (a
bus that powers and SIGKILLs the payload, the ground's events, uplink and results --wait)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit import free_ports

from hil.handrun import STEPS, TASK_ID, readme_block, run

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_shows_exactly_the_commands_the_script_runs():
    readme = (REPO / "README.md").read_text()
    marker = readme.index("<!-- the block below is hil.handrun.readme_block()")
    start = readme.index("```sh\n", marker) + len("```sh\n")
    block = readme[start : readme.index("```", start)]
    assert block == readme_block(), "README.md's hand-run block differs from hil/handrun.py: update one"
    # every command of the block is a step, in order (comments aside)
    commands = [line for line in block.splitlines() if line.startswith("ow ")]
    assert [c.split(" --")[0] for c in commands] == [s.command.split(" --")[0] for s in STEPS]


@pytest.mark.slow
def test_the_hand_run_runs_as_the_readme_says(tmp_path, monkeypatch):
    (tmp_path / "hil").mkdir()
    (tmp_path / "hil" / "samples").symlink_to(REPO / "hil" / "samples")
    commands, payload, telemetry = free_ports(3)
    monkeypatch.setenv("OW_COMMANDS_ENDPOINT", f"tcp://127.0.0.1:{commands}")
    monkeypatch.setenv("OW_PAYLOAD_ENDPOINT", f"tcp://127.0.0.1:{payload}")
    monkeypatch.setenv("OW_TELEMETRY_ENDPOINT", f"tcp://127.0.0.1:{telemetry}")
    said: list[str] = []
    report = run(tmp_path, say=said.append)
    steps = {s["command"].split(" --")[0]: s for s in report["steps"]}
    failures = [(s["command"], s["rc"], s["err"][-300:]) for s in report["steps"] if s["rc"] != 0]
    assert not failures, failures
    assert len(report["steps"]) == len(STEPS)
    task_id = report["task_id"]
    assert task_id and task_id.startswith("t-")
    result = steps[f"ow ground results --keys keys --wait {TASK_ID}".split(" --")[0]]
    assert f"task          {task_id}" in result["out"] and "text:" in result["out"]
    # waiting asked while the task ran: the answer is "not yet", never a rejection
    events = steps["ow ground events"]["out"]
    assert "REJECTED" not in events and " NOT_READY " in events
    assert result["err"].count(": started") <= 1  # a resume is named as one, never "started" again
    survived = int(result["out"].split("interruptions ")[1].split()[0])
    assert "recoveries    " in result["out"] and " of checkpoint records over every boot" in result["out"]
    if survived:  # (a fast machine may finish the task before the first cut: nothing to resume)
        assert f"task {task_id}: resumed after cut 1" in result["err"]
    # the bus (after the trace too) and events ran until their Ctrl-C, which ends them cleanly
    assert steps["ow bus run"]["rc"] == 0 and steps["ow ground events"]["rc"] == 0
