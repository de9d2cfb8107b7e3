"""The bus's boot-loop guard (issue 27, finding 3: "other boot loops with nothing on the ground").

A payload that fails to come up `boot_loop_limit` times in a row is held off -- power stays off
whatever the trace wants -- with a PAYLOAD_BOOT_LOOP event naming the reason its last boot gave,
until the ground sends PAYLOAD_RETRY (addressed to the bus) or the back-off expires (a
PAYLOAD_RETRY event). Real processes: the real `ow flight run` with a damaged key, and for each
power driver a payload that never comes up. No timed asserts: the order of the run log says
that nothing was powered while held.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from bus_testkit import LOOPBACK, ground_station, wait_for, window, write_trace

from common.wire import Apid, FdirMode, NodeId, ResponseCode, encode
from common.wire import messages as m
from common.wire.ids import EventId
from hil.bus import BusConfig, BusThread
from hil.bus import buslog as bl

# What the guard writes to the run log (docs/bus.md §7): a line per failed boot, and its two events
# as `bus_event` lines; spelled out so that a bus without the guard fails these tests by what it
# does, not by a missing name.
BOOT_FAILED, BOOT_LOOP, RETRY = "payload_boot_failed", "PAYLOAD_BOOT_LOOP", "PAYLOAD_RETRY"
#: A generous bound on waits for what a correct bus does within a second or two.
WAIT_S = 90.0


def _kinds(log, *kinds):
    """Entries of these kinds, or bus events of these names, in order."""
    return [e for e in log if e.kind in kinds or (e.kind == "bus_event" and e.get("event") in kinds)]


def _order(log) -> list[str]:
    """Power-ons, holds and retries in the order they happened."""
    return [e.get("event") if e.kind == "bus_event" else e.kind for e in _kinds(log, bl.POWER_ON, BOOT_LOOP, RETRY)]


def _holds(bus, count: int):
    """The run log once it holds `count` boot-loop holds, else None."""
    log = bl.read_log(bus.log_path)
    return log if len(_kinds(log, BOOT_LOOP)) >= count else None


def _damaged_payload_keys(tmp_path, keys):
    """The payload's keys directory with its secret key cut in half (as a bad copy leaves it)."""
    root = tmp_path / "payload-keys"
    (root / "clients").mkdir(parents=True)
    (root / "server").mkdir()
    secret = keys.client_secret("payload").read_bytes()
    (root / "clients" / "payload.key_secret").write_bytes(secret[: len(secret) // 2])
    shutil.copy(keys.client_public("payload"), root / "clients" / "payload.key")
    shutil.copy(keys.server_public, root / "server" / "bus.key")
    return root


def test_a_payload_with_a_damaged_key_is_held_off_until_the_ground_retries(tmp_path, keys, context):
    """The real flight process with a truncated key: one line saying why and exit status 5 (no
    traceback); after 2 such boots the bus holds it off naming that line, refuses a retry from an
    ordinary station or addressed to the payload, powers it once more on the ground's
    PAYLOAD_RETRY, and holds it again when that boot fails too."""
    from ground.client import GroundClient, GroundOptions

    model = tmp_path / "model"  # a model directory the key check comes before
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_vl"}')
    trace = write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    config = BusConfig(
        trace=str(trace),
        data_dir=tmp_path / "bus",
        keys_dir=keys.root,
        time_scale=1.0,
        endpoints=LOOPBACK,
        model=str(model),
        payload_keys_dir=str(_damaged_payload_keys(tmp_path, keys)),
        fdir_off_s=0.1,
        boot_timeout_s=120.0,
        boot_loop_limit=2,
        boot_loop_backoff_s=0.0,  # held until the ground says otherwise
    )
    with BusThread(config) as bus:
        log = wait_for(lambda: _holds(bus, 1), WAIT_S, what="the hold")
        hold = _kinds(log, BOOT_LOOP)[0]
        assert hold["failed_boots"] == 2 and hold["backoff_s"] is None
        assert "payload key" in hold["reason"] and "exit status 5" in hold["reason"], hold["reason"]
        assert [e["reason"] for e in _kinds(log, BOOT_FAILED)] == [hold["reason"]] * 2

        # Only an admin station's PAYLOAD_RETRY, addressed to the bus, ends the hold.
        refusals = []
        for name, source, apid, message in (
            ("station2", 0x0010, Apid.BUS, m.PayloadRetry()),  # an ordinary station
            ("ground", NodeId.GROUND, Apid.PAYLOAD, m.PayloadRetry()),  # addressed to the payload
            ("ground", NodeId.GROUND, Apid.BUS, m.Ping(key=7)),  # the bus takes nothing else
        ):
            station = ground_station(context, keys, bus.endpoints.commands, name, source)
            station.send_raw(encode(message, apid, 1, source_id=source))
            station.wait(lambda inbox: inbox, WAIT_S)
            header, report = station.inbox[0]
            assert header.apid == Apid.BUS and isinstance(report, m.Rejected)
            refusals.append(report.code)
            station.sock.close(linger=0)
        assert refusals == [ResponseCode.NOT_AUTHORIZED, ResponseCode.WRONG_APID, ResponseCode.WRONG_APID]

        with GroundClient(
            keys.root, GroundOptions(endpoints=bus.endpoints, timeout_s=30.0, notify=lambda s: None)
        ) as ground:
            seen: list = []
            ground.observers.append(seen.append)
            ground.payload_retry()  # ACCEPTED and COMPLETED, from the bus

            def held_again() -> bool:
                messages = [p.message for p in seen]
                return any(isinstance(x, m.Event) and x.event_id == EventId.PAYLOAD_BOOT_LOOP for x in messages) and (
                    isinstance(messages[-1], m.FdirReport) and messages[-1].mode == FdirMode.SAFE
                )

            for _ in ground.telemetry(WAIT_S):
                if held_again():
                    break
            assert held_again(), [type(p.message).__name__ for p in seen]
        log = bl.read_log(bus.log_path)

    # While held nothing was powered: two boots, the hold, the retry, one boot, the hold again.
    order = _order(log)
    assert order[:5] == [bl.POWER_ON, bl.POWER_ON, BOOT_LOOP, RETRY, bl.POWER_ON], order
    assert order[5] == BOOT_LOOP and order[6:] == [], order
    retry = _kinds(log, RETRY)[0]
    assert retry["origin"] == "ground" and retry["sender"] == "ground"
    events = [p for p in seen if isinstance(p.message, m.Event)]
    assert [p.message.event_id for p in events] == [EventId.PAYLOAD_RETRY, EventId.PAYLOAD_BOOT_LOOP]
    assert all(p.header.apid == Apid.BUS and p.header.source_id == NodeId.BUS for p in events)
    assert "payload key" in events[1].message.text and "3 failed boots" in events[1].message.text
    reports = [p.message for p in seen if isinstance(p.message, m.FdirReport)]
    assert reports[-1].mode == FdirMode.SAFE and "boot loop" in (reports[-1].last_fault or "")
    # One line of reason per boot, no traceback.
    output = (tmp_path / "bus" / bl.PAYLOAD_LOG_FILE).read_text()
    assert "Traceback" not in output and output.count('{"boot_failed"') == 3, output[-2000:]


@pytest.mark.parametrize("driver", ["local", "ssh", "command"])
def test_each_driver_names_the_reason_and_the_back_off_releases_the_hold(tmp_path, keys, driver):
    """What the guard can know of a boot depends on the driver: a local process killed by a
    signal (its exit status), a record the payload printed before it exited (read from its
    output, here through an ssh session), a relay-switched board that never connected (the boot
    timeout). Each hold is released by the back-off (a PAYLOAD_RETRY of origin `backoff`),
    doubled at each consecutive hold."""
    trace = write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    settings: dict = dict(
        trace=str(trace),
        data_dir=tmp_path / "bus",
        keys_dir=keys.root,
        time_scale=1.0,
        endpoints=LOOPBACK,
        fdir_off_s=0.05,
        boot_loop_limit=2,
        boot_loop_backoff_s=0.2,
    )
    if driver == "local":
        settings.update(payload_command=["sh", "-c", "kill -9 $$"])  # as the OOM killer would
        expected = "killed by SIGKILL"
    elif driver == "ssh":
        record = '{{"boot_failed": "no model on the board", "exit_status": 7}}'  # braces: template escapes
        settings.update(
            power_driver="ssh",
            ssh_transport=["bash", "-c"],
            ssh_pidfile=str(tmp_path / "remote.pid"),
            payload_command=[sys.executable, "-c", f"import sys; print('{record}', file=sys.stderr); sys.exit(7)"],
        )
        expected = "no model on the board (exit status 7)"
    else:
        settings.update(
            power_driver="command",
            power_on_command="true",  # the relay clicks; the board never brings the payload up
            power_off_command="true",
            boot_timeout_s=0.3,
            model=str(tmp_path),  # the board's own flight command is not the bus's to run
        )
        expected = "never connected"
    with BusThread(BusConfig(**settings)) as bus:
        log = wait_for(lambda: _holds(bus, 2), WAIT_S, what="two holds")
    holds = _kinds(log, BOOT_LOOP)
    assert all(expected in h["reason"] for h in holds), [h["reason"] for h in holds]
    assert [h["backoff_s"] for h in holds[:2]] == [0.2, 0.4]
    order = _order(log)
    assert order[:6] == [bl.POWER_ON, bl.POWER_ON, BOOT_LOOP, RETRY, bl.POWER_ON, BOOT_LOOP], order
    assert _kinds(log, RETRY)[0]["origin"] == "backoff"


def test_a_payload_at_work_that_is_killed_now_and_then_is_not_a_boot_loop(tmp_path, keys):
    """Found merging the guard with the chaos campaign: OOM kills of a payload at work, each soon
    after its boot connected, counted as boots that failed to come up, and enough of them in a row
    would hold off a payload that was doing its work. A boot that reports a unit of a task's work
    came up, however soon it ends: the count starts again."""
    from bus_testkit import bus_config

    trace = write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    config = bus_config(
        tmp_path,
        keys,
        trace,
        record,
        payload_args=("--work-then-exit", "0.3"),
        fdir_off_s=0.05,
        boot_loop_limit=2,
        boot_loop_backoff_s=0.0,
    )
    with BusThread(config) as bus:
        log = wait_for(
            lambda: (lambda entries: entries if len(_kinds(entries, bl.PAYLOAD_EXITED)) >= 4 else None)(
                bl.read_log(bus.log_path)
            ),
            WAIT_S,
            what="four boots at work, each killed",
        )
    assert not _kinds(log, BOOT_FAILED, BOOT_LOOP), [e.kind for e in _kinds(log, BOOT_FAILED, BOOT_LOOP)]
