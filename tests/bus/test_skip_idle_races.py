"""Skip-idle must not jump the trace clock while a ground station is still in an exchange with an
idle payload (docs/bus.md §1 "Skipping idle spans"):

- a cut took the answer to a command the payload had run (the redelivery is refused as a replay
  and that refusal is the bus's business), or the reply to one it had accepted: the station
  will ask again after its own time-out, and until it has heard from the payload again the bus
  holds skip-idle (a `skip_held` line says why);
- between an answer of the payload and the ground's next command the payload looks idle: skip-idle
  waits until the ground link has been quiet GROUND_QUIET_S.

Real bus, real ZeroMQ on loopback, a real payload process (tests/bus/withholding_payload.py) cut
with SIGKILL. The order of events is the test's: the payload's first boot withholds answers, the
cut lands when the test asks for it (a pacer moves trace time to it, as replays move theirs), and
the ground sends its next command only once the bus has looked at the idle payload. Every wait is a
hang guard.
"""

from __future__ import annotations

import sys
import threading

from bus_testkit import HERE, bus_config, ground_station, read_record, wait_for, window, write_trace

import hil.bus.timeline as timeline_module
from common.wire import messages as m
from hil.bus import BusConfig, BusThread
from hil.bus import buslog as bl
from traces import CutCause

PEER = HERE / "withholding_payload.py"
#: hang guard of every wait: a loaded machine only makes them longer
GUARD_S = 120.0


class OrderPacer:
    """The test's hand on the bus loop (`Bus(pacer=...)`, the replays' interface): it counts the
    loop's rounds and the idle housekeeping reports taken in, and, when asked, moves trace time
    to the next cut so that the cut lands then."""

    def __init__(self) -> None:
        self.rounds = 0
        #: the round in which the latest empty-queue HOUSEKEEPING was taken in
        self.idle_report_round: int | None = None
        self.cut_requested = threading.Event()

    def payload_message(self, bus, message, now: float) -> None:
        if isinstance(message, m.Housekeeping) and message.queue_depth == 0:
            self.idle_report_round = self.rounds

    def step(self, bus, now: float) -> None:
        self.rounds += 1
        if self.cut_requested.is_set():
            self.cut_requested.clear()
            actions = bus.timeline.actions
            if actions and actions[0].kind == "cut":
                bus.clock.t0 -= bus.clock.at(actions[0].trace_s) - now

    def wait_until_idle_seen(self, mark: int) -> None:
        """Until skip-idle has judged the payload after an empty-queue report taken in after round
        `mark` (in the round after that report's, skip-idle runs right after step())."""

        def seen() -> bool:
            report = self.idle_report_round
            return report is not None and report > mark and self.rounds >= report + 2

        wait_for(seen, GUARD_S, what="the bus to look at the idle payload after the answer")


def peer_config(tmp_path, keys, trace, record, answers: str, **overrides) -> BusConfig:
    command = [sys.executable, str(PEER), "--keys", "{keys}", "--endpoint", "{payload_endpoint}"]
    command += ["--record", str(record), "--first-boot-answers", answers]
    settings = dict(time_scale=1.0, skip_idle=True, heartbeat_timeout_s=600.0, boot_timeout_s=600.0)
    settings.update(overrides)
    return bus_config(tmp_path, keys, trace, record, payload_command=command, **settings)


def entries(bus: BusThread) -> list[bl.BusLogEntry]:
    return bl.read_log(bus.log_path)


def index_of(log, predicate, start: int = 0) -> int | None:
    return next((i for i in range(start, len(log)) if predicate(log[i])), None)


def idle_skip(e) -> bool:
    return e.kind == bl.CLOCK_SKIP and e["reason"] == "payload idle"


def last_report(log, seq: int) -> int:
    """Where the payload's last report about request `seq` is in the log."""

    def about(e) -> bool:
        return e.kind == bl.PAYLOAD_REPORT and (e.get("request") or {}).get("seq") == seq

    return max(i for i, e in enumerate(log) if about(e))


def completed(seq: int):
    return lambda inbox: any(isinstance(msg, m.Completed) and msg.request.seq == seq for _, msg in inbox)


def run_lost_answer(tmp_path, keys, context, answers: str) -> None:
    """The payload runs a PING, its first boot sends `answers` of what it owes, the test cuts it;
    after the next power-on the station is still waiting. The bus must hold skip-idle (a
    `skip_held` line) until the station has asked again and heard; then it skips."""
    trace = write_trace(
        tmp_path / "cut.jsonl", 5000, [window(0, 1000, CutCause.POWER), window(1100, 5000, None)], telemetry=False
    )
    record = tmp_path / "payload.jsonl"
    pacer = OrderPacer()
    bus = BusThread(peer_config(tmp_path, keys, trace, record, answers), pacer=pacer).start()
    try:
        ground = ground_station(context, keys, bus.endpoints.commands)
        _, first_seq = ground.send(m.Ping(key=41))
        wait_for(
            lambda: any(r["ev"] == "accepted" and r["seq"] == first_seq for r in read_record(record)),
            GUARD_S,
            what="the payload to run the PING",
        )
        if answers == "accepted":  # the ACCEPTED reached the ground; the PONG is still owed
            ground.wait(lambda inbox: any(isinstance(msg, m.Accepted) for _, msg in inbox), GUARD_S)
        pacer.cut_requested.set()

        def second_boot_judged():
            log = entries(bus)
            ons = [i for i, e in enumerate(log) if e.kind == bl.POWER_ON]
            if len(ons) < 2:
                return None
            found = index_of(log, lambda e: e.kind == bl.SKIP_HELD or idle_skip(e), ons[1])
            return None if found is None else (log, found)

        log, found = wait_for(second_boot_judged, GUARD_S, what="skip-idle to judge the payload after the cut")
        assert [e["cause"] for e in log if e.kind == bl.POWER_OFF] == ["low_battery"]
        if answers == "none":  # the redelivery was refused as a replay, and not passed on
            assert any(e.kind == bl.COMMAND_CONFIRMED and e["how"] == "redelivery_duplicate" for e in log)
        assert log[found].kind == bl.SKIP_HELD, (
            f"the bus jumped from trace {log[found].get('from_trace_s')} s to {log[found].get('to_trace_s')} s "
            "while the ground still waited for the answer the cut took"
        )
        (held,) = log[found]["stations"]
        assert held["station"] in ("ground", None) and held["source"] == ground.source_id
        assert [r["seq"] for r in held["owed"]] == [first_seq]
        assert not any(idle_skip(e) for e in log[found:])

        # The ground asks again (its time-out, here the test's turn); once it hears, skipping resumes.
        _, again_seq = ground.send(m.Ping(key=41))
        ground.wait(completed(again_seq), GUARD_S)
        log = wait_for(
            lambda: (log := entries(bus)) and index_of(log, idle_skip, found) is not None and log,
            GUARD_S,
            what="skip-idle to resume once the station heard from the payload",
        )
        answered = last_report(log, again_seq)
        assert index_of(log, idle_skip, found) > answered
    finally:
        bus.stop()


def test_a_cut_that_takes_a_run_commands_answer_holds_skip_idle_until_the_station_hears_again(tmp_path, keys, context):
    run_lost_answer(tmp_path, keys, context, "none")


def test_a_cut_that_takes_an_owed_reply_holds_skip_idle_until_the_station_hears_again(tmp_path, keys, context):
    run_lost_answer(tmp_path, keys, context, "accepted")


def test_skip_idle_waits_for_the_ground_between_an_answer_and_its_next_command(tmp_path, keys, context, monkeypatch):
    """An image upload is many turns of command and answer; between them the payload is idle. The
    bus must not take the ground's turn for idleness: however long the ground takes (here the
    quiet period is made longer than any turn), no jump until it has been quiet that long."""
    trace = write_trace(tmp_path / "on.jsonl", 10000, [window(0, 10000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    pacer = OrderPacer()
    config = peer_config(tmp_path, keys, trace, record, "all", hold_at_s=(1000.0, 2000.0, 3000.0))
    bus = BusThread(config, pacer=pacer).start()
    try:
        wait_for(lambda: any(idle_skip(e) for e in entries(bus)), GUARD_S, what="a first jump over idle time")
        quiet_s = timeline_module.GROUND_QUIET_S
        monkeypatch.setattr(timeline_module, "GROUND_QUIET_S", 3600.0)
        ground = ground_station(context, keys, bus.endpoints.commands)
        _, first_seq = ground.send(m.Ping(key=7))
        ground.wait(completed(first_seq), GUARD_S)
        pacer.wait_until_idle_seen(pacer.rounds)  # the ground's turn: the bus has seen the payload idle
        _, second_seq = ground.send(m.Ping(key=8))
        ground.wait(completed(second_seq), GUARD_S)

        log = entries(bus)

        def received(seq):
            return index_of(log, lambda e: e.kind == bl.COMMAND_RECEIVED and e["request"]["seq"] == seq)

        first, second = received(first_seq), received(second_seq)
        assert first is not None and second is not None
        jumped = [e for e in log[first:second] if e.kind == bl.CLOCK_SKIP]
        assert not jumped, f"skip-idle jumped during the ground's turn: {[e.data for e in jumped]}"

        # Quiet for the real period: skipping resumes after the last answer.
        monkeypatch.setattr(timeline_module, "GROUND_QUIET_S", quiet_s)
        log = wait_for(
            lambda: (log := entries(bus)) and index_of(log, idle_skip, second) is not None and log,
            GUARD_S,
            what="skip-idle to resume once the ground is quiet",
        )
        answered = last_report(log, second_seq)
        assert index_of(log, idle_skip, second) > answered
    finally:
        bus.stop()
