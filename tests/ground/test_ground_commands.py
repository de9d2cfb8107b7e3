"""status, ping, results (with --wait), cancel, priority, events and keys init against the
scripted test peer."""

from __future__ import annotations

import json
import threading

import pytest
from ground_test_peer import RESULT_TEXT
from ground_testkit import link_args

from common.wire import EventId, FdirMode, MessageType, PowerCause, ResponseCode, TaskPhase
from common.wire import messages as m
from common.wire.link import bind_station
from ground.state import GroundState


def uplinked_task(ow, keys, peer, pictures, *extra) -> str:
    result = ow(
        "ground", "uplink", *link_args(keys, peer), "--image", pictures[1], "--prompt", "count the ships", *extra
    )
    assert result.code == 0, result.err
    return result.out.strip()


def test_status_prints_housekeeping(ow, keys, peer, pictures):
    task_id = uplinked_task(ow, keys, peer, pictures)
    text = ow("ground", "status", *link_args(keys, peer))
    assert text.code == 0, text.err
    assert "queue depth   1 task(s)" in text.out
    assert f"current task  {task_id} (prefill 1/4)" in text.out
    assert "disk free     9.0 GiB" in text.out and "boot count    1" in text.out
    assert "storage       ok (reserve " in text.out
    assert "written       5.0 MiB to data storage since this boot" in text.out
    assert "memory        300.0 MiB resident" in text.out
    as_json = ow("ground", "status", *link_args(keys, peer), "--json")
    hk = json.loads(as_json.out)
    assert hk["queue_depth"] == 1 and hk["current_task"] == task_id and hk["phase"] == "prefill"
    assert hk["checkpoint_bytes"] == 123456
    assert (hk["memory_rss_bytes"], hk["written_bytes"]) == (300 * 1024**2, 5 * 1024**2)


def test_status_of_a_payload_that_reports_no_memory_or_wear():
    """An older payload's HOUSEKEEPING has neither field (wire-protocol.md §3.3): said so, not 0."""
    from common.wire import messages as m
    from ground.report import describe, housekeeping_text

    hk = m.Housekeeping(
        queue_depth=0,
        current_task=None,
        phase=None,
        progress_done=0,
        progress_total=0,
        checkpoint_bytes=0,
        disk_free_bytes=1,
        boot_count=1,
        command_count=0,
        error_count=0,
        uptime_s=1.0,
    )
    text = housekeeping_text(hk)
    assert "written       not reported (older payload)" in text
    assert "memory        not reported (older payload)" in text
    assert "memory" not in describe(hk) and "written" not in describe(hk)


def test_result_of_a_payload_that_reports_no_recoveries():
    """An older payload's TASK_RESULT has no recovery_* or written_bytes (wire-protocol.md
    §3.3): said so, never "no restart" or 0 B; a task never restarted says so."""
    from ground.report import result_json, result_text

    old = m.TaskResult(task_id="t1", token_ids=[5], text="x", logits_sha256=bytes(32), timings={}, interruptions=2)
    text = result_text(old)
    assert "recoveries    not reported (older payload)" in text
    assert "written       not reported (older payload)" in text
    assert result_json(old)["recoveries"] is None and result_json(old)["written_bytes"] is None
    fresh = m.TaskResult(
        task_id="t2",
        token_ids=[5],
        text="x",
        logits_sha256=bytes(32),
        timings={},
        recovery_s=[],
        recovery_phases=[],
        recovery_planners=[],
        written_bytes=2048,
    )
    assert "recoveries    none (never restarted)" in result_text(fresh)
    assert "written       2.0 KiB of checkpoint records over every boot (2048 B)" in result_text(fresh)
    assert result_json(fresh)["recoveries"] == []


def test_ping_reports_round_trip_time(ow, keys, peer):
    text = ow("ground", "ping", *link_args(keys, peer))
    assert text.code == 0 and text.out.startswith("PONG from payload: ") and text.out.strip().endswith(" ms")
    lines = ow("ground", "ping", *link_args(keys, peer), "--count", "2", "--json").out.splitlines()
    assert [set(json.loads(line)) for line in lines] == [{"rtt_ms"}, {"rtt_ms"}]


def test_results_wait_follows_the_task_and_downlinks_its_result(ow, keys, peer, pictures):
    peer.task_run_s = 1.5
    task_id = uplinked_task(ow, keys, peer, pictures)
    result = ow("ground", "results", task_id, "--wait", "--poll", "20", *link_args(keys, peer))
    assert result.code == 0, result.err
    assert RESULT_TEXT in result.out and "tokens        3" in result.out and "interruptions 1" in result.out
    assert f"task {task_id}: prefill 4/4" in result.err  # progress followed on the telemetry link
    # each restart: time to resume, phase, plan; and the checkpoint bytes over every boot
    assert "recoveries    1 restart(s)" in result.out and "#1          0.125 s  prefill  optimal" in result.out
    assert "written       3.0 MiB of checkpoint records over every boot (3145728 B)" in result.out
    data = json.loads(ow("ground", "results", task_id, "--json", *link_args(keys, peer)).out)
    assert data["recoveries"] == [{"restore_s": 0.125, "phase": "prefill", "planner": "optimal"}]
    assert data["written_bytes"] == 3 * 1024 * 1024
    saved = json.loads((keys.state_dir / "results" / f"{task_id}.json").read_text())
    assert saved["text"] == RESULT_TEXT and saved["token_ids"] == [5, 6, 7]
    listing = ow("ground", "results", "--keys", keys.root)
    assert listing.code == 0 and task_id in listing.out and "completed" in listing.out
    assert json.loads(ow("ground", "results", "--keys", keys.root, "--json").out)[0]["state"] == "completed"


def test_results_of_an_unfinished_or_unknown_task_exit_3(ow, keys, peer, pictures):
    task_id = uplinked_task(ow, keys, peer, pictures)
    not_ready = ow("ground", "results", task_id, *link_args(keys, peer))
    assert not_ready.code == 3 and "RESULT_NOT_READY (504)" in not_ready.err
    unknown = ow("ground", "results", "t-nope", *link_args(keys, peer))
    assert unknown.code == 3 and "UNKNOWN_TASK (501)" in unknown.err


def test_results_wait_reports_a_task_failure_named_only_by_request_id(ow, keys, peer, pictures):
    task_id = uplinked_task(ow, keys, peer, pictures)
    timer = threading.Timer(1.0, peer.fail_task, args=(task_id, ResponseCode.INFERENCE_ERROR, "engine fault"))
    timer.start()
    try:
        result = ow("ground", "results", task_id, "--wait", "--poll", "20", *link_args(keys, peer))
    finally:
        timer.cancel()
    assert result.code == 3
    assert f"task {task_id} failed: INFERENCE_ERROR (600): engine fault" in result.err
    assert GroundState(keys.state_dir).task(task_id)["state"] == "failed"


def test_results_wait_gives_up_after_max_wait(ow, keys, peer, pictures):
    task_id = uplinked_task(ow, keys, peer, pictures)
    result = ow("ground", "results", task_id, "--wait", "--max-wait", "1", "--poll", "0.3", *link_args(keys, peer))
    assert result.code == 4 and "no result within 1 s" in result.err


def test_cancel_and_priority(ow, keys, peer, pictures):
    task_id = uplinked_task(ow, keys, peer, pictures)
    assert ow("ground", "priority", task_id, "9", *link_args(keys, peer)).code == 0
    assert peer.tasks[task_id]["priority"] == 9
    cancelled = ow("ground", "cancel", task_id, *link_args(keys, peer))
    assert cancelled.code == 0 and "cancel accepted" in cancelled.out
    assert peer.tasks[task_id]["state"] == "cancelled"
    again = ow("ground", "cancel", task_id, *link_args(keys, peer))
    assert again.code == 3 and "TASK_FINISHED (503)" in again.err
    # every command the CLI sent is in the station's command log (docs/ground.md "Command
    # log"), with who sent it, its answer code and round trip: the console's history reads it
    logged = GroundState(keys.state_dir).logged_commands()
    sent = [(e["origin"], e["command"], e["code"]) for e in logged]
    assert sent[0] == ("ow ground uplink", "IMAGE_QUERY", "OK")
    assert ("ow ground uplink", "IMAGE_CHUNK", "OK") in sent and ("ow ground uplink", "UPLINK_TASK", "OK") in sent
    assert sent[-3:] == [
        ("ow ground priority", "SET_PRIORITY", "OK"),
        ("ow ground cancel", "CANCEL_TASK", "OK"),
        ("ow ground cancel", "CANCEL_TASK", "TASK_FINISHED"),
    ]
    refused = logged[-1]
    assert refused["task_id"] == task_id and not refused["ok"] and refused["by"] == "payload"
    assert refused["rtt_ms"] >= 0 and refused["sends"] == 1 and len(refused["seq"]) == 1
    chunks = next(e for e in logged if e["command"] == "IMAGE_CHUNK")
    assert chunks["chunks"] >= 1 and "seq" not in chunks


TELEMETRY = [
    (m.Event(event_id=EventId.TASK_FAILED, text="task t-1 failed", task_id="t-1"), False),
    (m.Heartbeat(boot_count=3, uptime_s=12.5), False),
    (m.PowerReport(trace_time_s=5, payload_on=True, bus_voltage_v=28.1, payload_power_w=14.5, battery_soc=0.8), True),
    (m.ThermalReport(trace_time_s=5, payload_temp_c=41.0, bus_temp_c=20.0), True),
    (m.FdirReport(trace_time_s=5, mode=FdirMode.DEGRADED, fault_count=2, last_fault="bus undervoltage"), True),
    (m.ShutdownWarning(trace_time_s=5, lead_time_s=3.0, cause=PowerCause.ECLIPSE), True),
    (m.PowerStateChange(trace_time_s=8, payload_on=False, cause=PowerCause.ECLIPSE), True),
]


@pytest.fixture
def telemetry(peer):
    stop = peer.start_publishing(TELEMETRY, every_s=0.1)
    yield
    stop.set()


def test_events_prints_one_readable_line_per_packet(ow, keys, peer, telemetry):
    result = ow("ground", "events", *link_args(keys, peer), "--duration", "1.5")
    assert result.code == 0, result.err
    out = result.out
    assert "EVENT            WARNING_HI TASK_FAILED [t-1]: task t-1 failed" in out
    assert "POWER            payload on, bus 28.10 V, payload 14.5 W, battery 80 %" in out
    assert "THERMAL          payload 41.0 degC" in out
    assert "FDIR             mode degraded, 2 faults, last fault: bus undervoltage" in out
    assert "SHUTDOWN_WARNING payload power cut in 3.0 s (eclipse)" in out
    assert "POWER_STATE      payload power OFF (eclipse)" in out
    assert "HEARTBEAT" not in out
    numbers = [int(line.split()[0][1:]) for line in out.splitlines()]
    assert numbers == sorted(set(numbers)) and numbers[0] <= 2  # archived from #1 on (#1 may be a hidden heartbeat)


def test_events_json_heartbeats_and_archive_replay(ow, keys, peer, telemetry):
    live = ow("ground", "events", *link_args(keys, peer), "--duration", "1.0", "--heartbeats", "--json")
    records = [json.loads(line) for line in live.out.splitlines()]
    assert {"HEARTBEAT", "EVENT", "POWER", "SHUTDOWN_WARNING"} <= {r["type"] for r in records}
    event = next(r for r in records if r["type"] == "EVENT")
    assert event["severity"] == "WARNING_HI" and event["body"]["event_id"] == "TASK_FAILED"
    # A later run replays what the first one archived after the number it names.
    last = records[-1]["n"]
    replay = ow(
        "ground",
        "events",
        *link_args(keys, peer),
        "--since",
        str(last - 3),
        "--duration",
        "0.1",
        "--json",
        "--heartbeats",
    )
    replayed = [json.loads(line) for line in replay.out.splitlines()]
    assert [r["n"] for r in replayed[:3]] == [last - 2, last - 1, last]


def test_keys_init_reports_where_each_file_goes(ow, tmp_path):
    keys_dir = tmp_path / "station-keys"
    first = ow("ground", "keys", "init", "--keys", keys_dir)
    assert first.code == 0
    assert "clients/payload.key_secret" in first.out and "server/bus.key" in first.out and "(created)" in first.out
    assert (keys_dir / "clients" / "ground.key_secret").stat().st_mode & 0o077 == 0
    second = json.loads(ow("ground", "keys", "init", "--keys", keys_dir, "--json").out)
    assert second["clients"]["ground"]["state"] == "kept"
    forced = json.loads(
        ow("ground", "keys", "init", "--keys", keys_dir, "--force", "--json", "--client", "ground2").out
    )
    assert forced["server"]["state"] == "replaced" and forced["clients"]["ground2"]["state"] == "created"
    assert (keys_dir / "authorized" / "ground2.key").exists()


def test_keys_bind_each_station_to_a_source_id_and_the_tools_default_to_it(ow, tmp_path, peer, keys):
    """Finding 7b: `keys init` binds ground to 0x0001 (admin), each --client to the next station id,
    each --admin to the next admin id; `authorize` binds (or rebinds) a key, `revoke` removes it,
    `list` shows them; the ground tools send with their key's binding."""
    keys_dir = tmp_path / "ops-keys"
    made = json.loads(
        ow("ground", "keys", "init", "--keys", keys_dir, "--client", "alpha", "--admin", "ops", "--json").out
    )
    assert made["bindings"] == {
        "ground": {"source_id": 0x0001, "role": "admin"},
        "alpha": {"source_id": 0x0010, "role": "station"},
        "ops": {"source_id": 0x0002, "role": "admin"},
    }
    assert json.loads((keys_dir / "clients" / "alpha.station").read_text()) == {"source_id": 0x0010}
    again = json.loads(ow("ground", "keys", "init", "--keys", keys_dir, "--client", "beta", "--json").out)
    assert again["bindings"]["alpha"]["source_id"] == 0x0010 and again["bindings"]["beta"]["source_id"] == 0x0011
    taken = ow("ground", "keys", "authorize", "beta", "--keys", keys_dir, "--source-id", "0x10")
    assert taken.code == 5 and "already bound to key 'alpha'" in taken.err
    moved = json.loads(
        ow("ground", "keys", "authorize", "beta", "--keys", keys_dir, "--source-id", "0x20", "--json").out
    )
    assert moved == {"name": "beta", "source_id": 0x20, "role": "station"}
    kept = json.loads(ow("ground", "keys", "authorize", "ops", "--keys", keys_dir, "--json").out)
    assert kept == {"name": "ops", "source_id": 0x0002, "role": "admin"}, "authorize keeps a binding"
    assert ow("ground", "keys", "revoke", "alpha", "--keys", keys_dir).code == 0
    listed = {row["name"]: row for row in json.loads(ow("ground", "keys", "list", "--keys", keys_dir, "--json").out)}
    assert set(listed) == {"ground", "beta", "ops", "payload"}
    assert listed["payload"]["role"] == "payload" and listed["ops"]["role"] == "admin"
    assert ow("ground", "keys", "revoke", "alpha", "--keys", keys_dir).code == 5  # nothing left to revoke

    # The tools' default source id is their key's binding.
    bind_station(keys, "ground", 0x0003)
    assert ow("ground", "ping", *link_args(keys, peer)).code == 0
    assert peer.commands[-1][1].source_id == 0x0003
    assert ow("ground", "ping", "--source-id", "0x05", *link_args(keys, peer)).code == 0
    assert peer.commands[-1][1].source_id == 0x0005


@pytest.mark.parametrize(
    "action",
    [
        [],
        ["keys"],
        ["keys", "init"],
        ["keys", "authorize"],
        ["keys", "revoke"],
        ["keys", "list"],
        ["uplink"],
        ["status"],
        ["results"],
        ["events"],
        ["ping"],
        ["cancel"],
        ["priority"],
        ["console"],
    ],
)
def test_every_command_explains_itself(ow, action):
    result = ow("ground", *action, "--help")
    assert result.code == 0 and "usage: ow ground" in result.out and "exit status" in result.out


def test_console_beyond_loopback_refuses_to_start_without_token_and_tls(ow, tmp_path):
    result = ow("ground", "console", "--keys", str(tmp_path), "--host", "0.0.0.0", "--port", "0")
    assert result.code == 5 and "without a token" in result.err
    result = ow("ground", "console", "--keys", str(tmp_path), "--host", "0.0.0.0", "--port", "0", "--token", "t")
    assert result.code == 5 and "without TLS" in result.err


def test_a_refusal_by_the_bus_itself_is_exit_3_naming_the_bus(ow, keys, peer):
    peer.bus_rejects_next[MessageType.PING] = (ResponseCode.NOT_AUTHORIZED, "key may not command")
    result = ow("ground", "ping", *link_args(keys, peer))
    assert result.code == 3
    assert "PING rejected by the bus: NOT_AUTHORIZED (302): key may not command" in result.err
    assert peer.commands == []


# ---- display spoofing (issue 27, finding 9) -----------------------------------------------------
#
# Text from the payload (results, event texts, reasons, quarantine entries) and from an operator
# (prompts) reaches the terminal. A right-to-left override printed raw shows "gnp.exe" as
# "exe.png"; an ESC starts a terminal escape sequence; a CR overwrites the line. Every such
# character must be printed as a visible escape; --json keeps the exact text.

SPOOF = "harbour \u202egnp.exe\u202c clear\x1b[2J\rfake line\u200b\nsecond line\ttabbed\u2066\u2028end"
HIDDEN = "\u202e\u202c\x1b\r\u200b\u2066\u2028"
#: SPOOF on one line of a terminal (an event, a reason): every hidden character as its escape
SPOOF_LINE = "harbour \\u202egnp.exe\\u202c clear\\x1b[2J\\rfake line\\u200b\\nsecond line\\ttabbed\\u2066\\u2028end"


def _no_hidden(text: str) -> None:
    assert not any(ch in text for ch in HIDDEN), ascii(text)


def test_results_print_payload_and_operator_text_with_hidden_characters_escaped(ow, keys, peer, pictures):
    peer.task_run_s = 0.2
    peer.result_text = SPOOF
    task_id = uplinked_task(ow, keys, peer, pictures, "--prompt", "ships \u202egnp.exe\x1b[31m")
    shown = ow("ground", "results", task_id, "--wait", "--poll", "20", *link_args(keys, peer))
    assert shown.code == 0, shown.err
    _no_hidden(shown.out + shown.err)
    # the answer is a block: its line feed and tab stay, everything else hidden is escaped
    assert "harbour \\u202egnp.exe\\u202c clear\\x1b[2J\\rfake line\\u200b\nsecond line\ttabbed\\u2066\\u2028end" in (
        shown.out
    )
    exact = ow("ground", "results", task_id, *link_args(keys, peer), "--json")
    _no_hidden(exact.out)
    assert json.loads(exact.out)["text"] == SPOOF  # JSON: escaped by JSON's own rules, exact once parsed
    listing = ow("ground", "results", "--keys", keys.root)
    _no_hidden(listing.out)
    assert "ships \\u202egnp.exe\\x1b[31m" in listing.out
    assert json.loads(ow("ground", "results", "--keys", keys.root, "--json").out)[0]["prompt"] == (
        "ships \u202egnp.exe\x1b[31m"
    )


def test_events_reasons_and_quarantine_entries_are_escaped(ow, keys, peer):
    stop = peer.start_publishing(
        [(m.Event(event_id=EventId.TASK_FAILED, text=f"task t-1: {SPOOF}", task_id="t-1"), False)], every_s=0.1
    )
    try:
        live = ow("ground", "events", *link_args(keys, peer), "--duration", "1.0")
        as_json = ow("ground", "events", *link_args(keys, peer), "--duration", "0.5", "--json")
    finally:
        stop.set()
    assert live.code == 0, live.err
    _no_hidden(live.out)
    line = next(line for line in live.out.splitlines() if "TASK_FAILED" in line)
    assert line.endswith(f"[t-1]: task t-1: {SPOOF_LINE}")
    _no_hidden(as_json.out)
    events = [json.loads(line) for line in as_json.out.splitlines()]
    assert any(e["body"].get("text") == f"task t-1: {SPOOF}" for e in events)
    # what the first run archived, replayed as text, is escaped as well
    replay = ow("ground", "events", *link_args(keys, peer), "--since", "0", "--duration", "0.1")
    _no_hidden(replay.out)
    assert "\\u202egnp.exe" in replay.out
    # a reason the payload gives for a refusal ends up in the one error line
    peer.reject_next[MessageType.PING] = (ResponseCode.BUSY, f"busy \u202e{SPOOF}")
    refused = ow("ground", "ping", *link_args(keys, peer))
    assert refused.code == 3
    _no_hidden(refused.err)
    assert len(refused.err.strip().splitlines()) == 1 and "busy \\u202eharbour" in refused.err
    peer.quarantined = m.QuarantineList(items=["task:t-2\u202e"], exits=[3], reasons=[SPOOF], total=1)
    listing = ow("ground", "quarantine", *link_args(keys, peer))
    assert listing.code == 0, listing.err
    _no_hidden(listing.out)
    assert listing.out.splitlines() == [f"task:t-2\\u202e  3 exit(s)  {SPOOF_LINE}"]


ROUTINE = [
    (m.FdirReport(trace_time_s=1, mode=FdirMode.NOMINAL, fault_count=0, last_fault=None), True),
    (m.Event(event_id=EventId.TASK_STARTED, text="task t-2 started", task_id="t-2"), False),
]


def test_events_prints_routine_fdir_only_when_it_changes(ow, keys, peer):
    # The bus's once-a-second "FDIR mode nominal, 0 faults" was 65 % of what --follow printed.
    stop = peer.start_publishing(ROUTINE, every_s=0.1)
    try:
        quiet = ow("ground", "events", *link_args(keys, peer), "--duration", "1.5")
        every = ow("ground", "events", *link_args(keys, peer), "--duration", "1.0", "--all")
    finally:
        stop.set()
    assert quiet.code == 0 and every.code == 0, quiet.err + every.err
    lines = quiet.out.splitlines()
    assert sum(" FDIR " in line for line in lines) == 1, quiet.out
    assert sum("TASK_STARTED" in line for line in lines) >= 5  # everything else as before
    assert sum(" FDIR " in line for line in every.out.splitlines()) >= 5, every.out
    # nothing is lost: the archive holds every FDIR report the first run received
    archived = [json.loads(line) for line in (keys.state_dir / "telemetry.jsonl").read_text().splitlines()]
    first_run = [e for e in archived if e["n"] <= int(lines[-1].split()[0][1:])]
    assert sum(e["type"] == "FDIR" for e in first_run) >= 5
    # a change is printed at once, whatever came before
    from ground.report import RoutineFilter

    routine = RoutineFilter()
    nominal = {"mode": "nominal", "fault_count": 0, "last_fault": None}
    assert routine.show("FDIR", nominal, 0.0) and not routine.show("FDIR", nominal, 1.0)
    assert routine.show("FDIR", dict(nominal, fault_count=1, last_fault="bus undervoltage"), 2.0)
    assert routine.show("POWER", {"payload_on": True}, 0.0) and not routine.show("POWER", {"payload_on": True}, 30)
    assert routine.show("POWER", {"payload_on": False}, 31) and routine.show("POWER", {"payload_on": False}, 95)


def test_results_wait_follows_a_running_task_without_asking_again_and_names_its_resumes(ow, keys, peer, pictures):
    # issue 33: --wait asked DOWNLINK_RESULT every --poll seconds; each RESULT_NOT_READY answer
    # counted as "rejected or failed" in status and read PAYLOAD REJECTED in events, and after a
    # cut its progress said "started" again
    peer.task_run_s = 2.5
    task_id = uplinked_task(ow, keys, peer, pictures)
    request = peer.tasks[task_id]["request"]
    running = [
        (m.Started.about(request, task_id=task_id), False),
        (m.Event(event_id=EventId.TASK_RESUMED, text=f"task {task_id} resumed after 2 cut(s)", task_id=task_id), False),
        (m.Progress.about(request, task_id=task_id, phase=TaskPhase.PREFILL, done=2, total=4), False),
    ]
    stop = peer.start_publishing(running, every_s=0.1)  # a task the payload is running, heard from
    try:
        result = ow("ground", "results", task_id, "--wait", "--poll", "0.5", *link_args(keys, peer))
    finally:
        stop.set()
    assert result.code == 0, result.err
    asked = [msg for _, _, msg in peer.commands if isinstance(msg, m.DownlinkResult)]
    assert len(asked) == 2, result.err  # once (not ready), once after its COMPLETED
    assert f"task {task_id}: resumed after cut 2" in result.err
    assert f"task {task_id}: started" not in result.err


def test_the_not_yet_answer_is_shown_as_not_ready_never_as_a_rejection():
    from common.wire import RequestRef
    from ground.report import NOT_READY, archived_line, describe, shown_type, to_jsonable

    ref = RequestRef(apid=0x020, source_id=1, seq=5, message_type=int(MessageType.DOWNLINK_RESULT))
    not_yet = m.Rejected.about(ref, code=ResponseCode.RESULT_NOT_READY, reason="task t-1 is running", task_id="t-1")
    assert not_yet.not_yet and shown_type(not_yet) == NOT_READY
    assert describe(not_yet).endswith("task t-1: not finished yet (task t-1 is running)")
    entry = {"n": 7, "sent": "2026-12-05T05:00:00.000Z", "apid": 0x020, "type": "REJECTED", "text": describe(not_yet)}
    entry["body"] = to_jsonable(not_yet)
    assert " NOT_READY " in archived_line(entry) and "REJECTED" not in archived_line(entry)
    # the same code to another command is a rejection as before
    other = m.Rejected.about(
        RequestRef(apid=0x020, source_id=1, seq=6, message_type=int(MessageType.CANCEL_TASK)),
        code=ResponseCode.RESULT_NOT_READY,
        reason="x",
    )
    assert not other.not_yet and shown_type(other) == "REJECTED"
