"""The chaos campaign (issue 27, "Done when": at a size that fits in `make test`; docs/hil.md "Red
team"): the real bus, payload and ground, the trace's cuts and a bus kill mixed with every other
fault kind -- the payload's data disk full, flapping between full and free, read-only, failing
with EIO and stalling its fsyncs, an OOM kill from outside the bus, a flood from a second station
-- while a probe station PINGs the payload. Nothing may be lost, run twice or answered wrong, no
exit or power cycle but the OOM kill's, no fault event, and every PING answered within 5 s while
the payload was powered and connected. The full size is `python -m bench.redteam --chaos`."""

from __future__ import annotations

import json
import threading

import pytest

from hil.bus import buslog as bl
from hil.chaos import (
    FAULT_KINDS,
    INJECTED_KINDS,
    ChaosCampaign,
    StorageControl,
    _connected_throughout,
    plan_faults,
)
from hil.redteam import RunLogTail, TaskShape


@pytest.mark.slow
def test_a_small_chaos_campaign_loses_nothing_and_answers_every_ping(model_dirs, tmp_path):
    report = ChaosCampaign(
        str(tmp_path / "chaos"),
        model_dirs["qwen3-vl"],
        faults=12,  # every kind once, a bus kill, four cuts
        seed=1,
        spell_s=(1.0, 1.5),
        stall_s=(2.0, 2.5),
        flap_s=(0.3, 0.6),
        flood_pings=(200, 300),
        gap_s=(0.2, 0.6),
        work_s=(2.0, 6.0),
        probe_every_s=1.0,
        outstanding=4,
        pace_ms=20,
        boot_s=0.5,
        task_shape=TaskShape(images=(1, 1), width=(32, 96), height=(32, 96), words=(1, 40), tokens=(1, 8)),
        say=lambda s: None,
    ).run()
    summary = report.summary()
    assert all(report.faults_by_kind[kind] >= 1 for kind in FAULT_KINDS), summary
    assert report.completed == report.tasks > 0, summary
    assert report.lost == [] and report.run_twice == [] and report.answered_wrong == [], summary
    assert report.crash_loops == 0, f"{summary}; quarantined {report.quarantined}"
    assert report.failure_events == {}, summary
    assert report.pings_counted > 0 and report.pings_late == [], f"{summary}; {report.pings_late}"
    assert report.pings_rejected == [], report.pings_rejected
    assert report.passed, summary


def test_a_plan_has_every_kind_and_the_share_asked_for():
    small = plan_faults(12, seed=0)
    assert small.total == 12 and set(small.injected) == set(INJECTED_KINDS)
    assert 1 <= small.bus_kills and small.bus_kills * small.bus_kill_every < small.kills  # before the last cut
    full = plan_faults(500, seed=0)
    assert full.total == 500 and full.kills == 150 and full.bus_kills == 20
    assert plan_faults(500, seed=0) == full and plan_faults(500, seed=1) != full
    with pytest.raises(ValueError):
        plan_faults(8, seed=0)


def test_a_ping_counts_only_inside_one_connection_that_lasts_its_five_seconds():
    starts, ends = [10.0, 30.0], [20.0, 40.0]  # connected 10-20 and 30-40
    assert _connected_throughout(starts, ends, 12.0, 17.0)
    assert not _connected_throughout(starts, ends, 16.0, 21.0)  # sent just before a cut
    assert not _connected_throughout(starts, ends, 25.0, 30.0)  # sent while off
    assert not _connected_throughout(starts, ends, 9.0, 14.0)  # sent before the payload connected
    assert _connected_throughout(starts, ends, 34.5, 39.5)
    assert not _connected_throughout(starts, ends, 50.0, 55.0)


def _entry(n: int, kind: str, utc: float, **data) -> bl.BusLogEntry:
    return bl.BusLogEntry(run="r", n=n, kind=kind, utc=utc, wall_s=utc, trace_s=None, clock_s=None, data=data)


def test_only_the_injected_oom_kills_exits_are_excused(tmp_path):
    """An exit of a payload the campaign SIGKILLed, FDIR's answer and the next boot's ABNORMAL_EXIT
    are expected; another exit, its FDIR cycle and an ABNORMAL_EXIT after it are failures."""
    campaign = ChaosCampaign(str(tmp_path), str(tmp_path), faults=12)
    campaign.oom_kills = [(101, 5.0)]
    log = [
        (bl.RUN_START, {}),
        (bl.POWER_ON, {"pid": 101}),
        (bl.PAYLOAD_EXITED, {"status": -9}),  # our kill at 5.0
        (bl.FDIR_ACTION, {}),
        (bl.POWER_OFF, {"origin": "fdir"}),
        (bl.POWER_ON, {"pid": 102}),
        (bl.PAYLOAD_REPORT, {"type": "EVENT", "event": "ABNORMAL_EXIT"}),
        (bl.PAYLOAD_REPORT, {"type": "EVENT", "event": "STORAGE_FULL"}),
        (bl.PAYLOAD_EXITED, {"status": 1}),  # nobody killed 102
        (bl.FDIR_ACTION, {}),
        (bl.POWER_OFF, {"origin": "fdir"}),
        (bl.POWER_ON, {"pid": 103}),
        (bl.PAYLOAD_REPORT, {"type": "EVENT", "event": "ABNORMAL_EXIT"}),
        (bl.PAYLOAD_REPORT, {"type": "EVENT", "event": "ITEM_QUARANTINED", "text": "task:t quarantined"}),
    ]
    entries = [_entry(i, kind, 4.0 + i, **data) for i, (kind, data) in enumerate(log)]
    report = campaign._new_report()
    report.quarantined = ["task:t quarantined"]
    assert campaign._judge_exits(report, entries) == 1
    assert (report.oom_fdir_cycles, report.oom_abnormal_exits) == (1, 1)
    assert (report.other_exits, report.other_fdir_cycles) == (1, 1)
    assert report.failure_events == {"ABNORMAL_EXIT": 1, "ITEM_QUARANTINED": 1}
    assert report.storage_events == {"STORAGE_FULL": 1}
    assert report.crash_loops == 3


def test_the_campaign_follows_its_run_log_across_a_rotation_and_a_torn_line(tmp_path):
    path = tmp_path / "bus-log.jsonl"

    def line(n: int, kind: str, **data) -> bytes:
        entry = {"run": "r", "n": n, "kind": kind, "utc": n, "wall_s": n, "trace_s": float(n), "clock_s": None}
        return (json.dumps({**entry, **data}) + "\n").encode()

    tail = RunLogTail(str(path))
    assert tail.read() == []
    path.write_bytes(line(1, bl.RUN_START) + line(2, bl.POWER_OFF, origin="trace") + line(3, bl.POWER_ON)[:20])
    assert [e.n for e in tail.read()] == [1, 2]
    path.rename(tmp_path / "bus-log.jsonl.1")  # rotated with a line torn by a killed bus
    path.write_bytes(line(4, bl.RUN_START) + line(5, bl.POWER_OFF, origin="trace") + line(6, bl.POWER_ON)[:9])
    assert [e.n for e in tail.read()] == [4, 5]
    with open(path, "ab") as f:
        f.write(line(6, bl.POWER_ON)[9:])
    assert [e.n for e in tail.read()] == [6]
    assert (tail.trace_cuts, tail.last_trace_s) == (2, 6.0)
    tail.close()


def test_the_faults_left_when_the_trace_runs_out_of_cuts_follow_each_other(tmp_path):
    """Bus restarts skip the cuts of the windows the bus was killed in, so the trace can reach its
    last window (power on for good) before the plan's cuts are done. The injector schedules its
    faults by cuts; once no cut can come it must inject the rest one after another (it waited
    for cuts there, and a 500-fault campaign hung until stopped by hand)."""
    campaign = ChaosCampaign(str(tmp_path), str(tmp_path), faults=12)
    campaign.gap_s = (0.0, 0.0)
    campaign.storage = StorageControl(str(tmp_path / "storage-faults.json"), str(tmp_path / "payload"))
    campaign.log = RunLogTail(str(tmp_path / "none.jsonl"))
    campaign.log.trace_cuts = 1  # of the plan's campaign.kills
    campaign.settle_start = 50.0
    campaign.log.last_trace_s = 60.0  # in the last window
    campaign.commissioned.set()
    done: list[str] = []
    for kind in set(campaign.plan.injected):
        setattr(campaign, f"_inject_{kind}", lambda rng, kind=kind: done.append(kind))
    injector = threading.Thread(target=campaign._inject, daemon=True)
    injector.start()
    injector.join(timeout=60)
    alive = injector.is_alive()
    campaign.halt.set()
    assert not alive and campaign.injector_done.is_set()
    assert sorted(done) == sorted(campaign.plan.injected)
