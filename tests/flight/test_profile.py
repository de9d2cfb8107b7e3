"""What the payload measures for the ground's completion forecast (flight/runtime/profile.py)."""

from __future__ import annotations

from common.durable import DurableFS
from flight.runtime.profile import WorkProfile, append_start, read_starts


def test_the_payload_profile_and_window_starts_survive_a_restart(tmp_path):
    fs = DurableFS()
    log = str(tmp_path / "window-starts.log")
    assert append_start(fs, log, 100.0) == [100.0]
    assert append_start(fs, log, 160.0) == [100.0, 160.0]
    with open(log, "r+b") as f:  # a damaged entry is skipped, the rest kept
        f.write(b"\xff")
    assert read_starts(log) == [160.0]
    profile = WorkProfile(str(tmp_path / "profile.json"))
    profile.task_started(10.0)
    for done, t in ((1, 12.0), (2, 14.0), (3, 16.0)):
        profile.unit("prefill", done, 8, t, uptime=t)
    profile.task_ended(64)
    profile.save(fs)
    again = WorkProfile(str(tmp_path / "profile.json")).fields()
    assert again["unit_s"] == {"prefill": 2.0} and again["task_units"] == {"prefill": 8}
    assert again["overhead_s"] == 12.0 and again["setup_s"] == 2.0 and again["decode_tokens"] == 64
