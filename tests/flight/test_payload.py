"""The payload process on its own, driven by a scripted bus over the real (CURVE) payload link."""

import io
import os
import signal

import pytest
from testkit import HANG_S, make_images

from common.wire import Apid, NodeId, ResponseCode, encode
from common.wire import messages as m
from hil.scripted_bus import BusPeer, spawn_flight


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def bus(tmp_path):
    peer = BusPeer(str(tmp_path / "keys"))
    yield peer
    peer.close()


@pytest.fixture
def flight(bus, tmp_path, model_dirs):
    procs = []

    def start():
        p = spawn_flight(
            tmp_path / "data", model_dirs["qwen3-vl"], tmp_path / "keys", bus.endpoint, log_path=tmp_path / "flight.log"
        )
        procs.append(p)
        bus.wait_connected()
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _upload(bus, name, content):
    for chunk in m.ImageChunk.split(name, content, chunk_bytes=4096):
        seq = bus.command(chunk)
        bus.wait_for(lambda h, msg, seq=seq: isinstance(msg, (m.Accepted, m.Rejected)) and msg.tc_seq == seq)


def test_task_round_trip_and_bad_input(bus, flight, tmp_path, model_dirs):
    process = flight()
    imgs = [_png(im) for im in make_images()]
    _upload(bus, "first.png", imgs[0])
    _upload(bus, "second.png", imgs[1])
    seq = bus.command(
        m.UplinkTask(
            task_id="t1", prompt="count the ships", images=["first.png", "second.png"], max_new_tokens=5, priority=1
        )
    )

    # Asked for its result while it runs, the payload answers "not yet": no fault, not counted
    # among the rejected commands (wire-protocol.md §3.6; issue 33: a waiting ground's polls
    # showed as "rejected or failed" in ow ground status).
    def error_count() -> int:
        mark = len(bus.received)
        bus.command(m.Status())
        return bus.wait_for(lambda h, x: isinstance(x, m.Housekeeping), HANG_S, start=mark)[1].error_count

    errors_before = error_count()
    early = bus.command(m.DownlinkResult(task_id="t1"))
    answer = bus.wait_for(
        lambda h, x: (isinstance(x, m.Rejected) and x.tc_seq == early) or isinstance(x, m.TaskResult), 120
    )[1]
    if isinstance(answer, m.Rejected):  # (a task that finished first answers its result: nothing to check)
        assert answer.code == ResponseCode.RESULT_NOT_READY and answer.not_yet
        assert error_count() == errors_before
    bus.wait_for(lambda h, msg: isinstance(msg, m.Completed) and msg.task_id == "t1" and msg.tc_seq == seq, HANG_S)
    result = bus.wait_for(lambda h, msg: isinstance(msg, m.TaskResult) and msg.task_id == "t1")[1]
    assert len(result.token_ids) == 5
    # never restarted: an empty list of restarts (not nil), and the bytes of its checkpoint records
    assert result.recoveries == [] and result.written_bytes is not None and result.written_bytes > 0
    # HOUSEKEEPING's memory and wear (wire-protocol.md §3.3): the process's own resident memory,
    # as the kernel counts it; at least the two images and the task's records written this boot
    mark = len(bus.received)
    bus.command(m.Status())
    hk = bus.wait_for(lambda h, x: isinstance(x, m.Housekeeping), HANG_S, start=mark)[1]
    with open(f"/proc/{process.pid}/statm") as statm:
        rss_now = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert hk.memory_rss_bytes is not None and 0.5 * rss_now <= hk.memory_rss_bytes <= 2 * rss_now
    assert hk.written_bytes is not None and hk.written_bytes > len(imgs[0]) + len(imgs[1])
    # bad inputs, each with its own code, and the payload keeps serving
    cases = {
        ResponseCode.UNKNOWN_TASK: m.DownlinkResult(task_id="nope"),
        ResponseCode.DUPLICATE_TASK: m.UplinkTask(
            task_id="t1", prompt="other", images=[], max_new_tokens=3, priority=0
        ),
    }
    for code, msg in cases.items():
        s = bus.command(msg)
        rep = bus.wait_for(lambda h, x, s=s: isinstance(x, m.Rejected) and x.tc_seq == s)[1]
        assert rep.code == code
    bad_crc = bytearray(encode(m.Ping(key=1), Apid.PAYLOAD, bus.counter.next(Apid.PAYLOAD), source_id=NodeId.GROUND))
    bad_crc[-1] ^= 0xFF
    bus.raw(bytes(bad_crc))
    assert bus.wait_for(lambda h, x: isinstance(x, m.Rejected) and x.code == ResponseCode.BAD_CRC)
    replay = bus.counter.next(Apid.PAYLOAD)
    bus.command(m.Ping(key=2), seq=replay)
    bus.wait_for(lambda h, x: isinstance(x, m.Pong) and x.key == 2)
    bus.command(m.Ping(key=3), seq=replay)
    assert bus.wait_for(lambda h, x: isinstance(x, m.Rejected) and x.code == ResponseCode.REPLAYED_SEQUENCE)
    # the same uplink again is idempotent
    s = bus.command(
        m.UplinkTask(
            task_id="t1", prompt="count the ships", images=["first.png", "second.png"], max_new_tokens=5, priority=1
        )
    )
    assert (
        bus.wait_for(lambda h, x: isinstance(x, (m.Accepted, m.Rejected)) and x.tc_seq == s)[1].TYPE == m.Accepted.TYPE
    )
    s = bus.command(m.DownlinkResult(task_id="t1"))
    again = bus.wait_for(lambda h, x: isinstance(x, m.TaskResult) and x.task_id == "t1", start=0)[1]
    assert again.token_ids == result.token_ids


def test_write_costs_learned_in_one_boot_reach_the_next(bus, flight, tmp_path):
    """The adaptive cadence times its vision and decode record writes (and the vision states'
    write rate); the window-log thread keeps them in state/write-costs, and the next boot starts
    from them (engine.md "Cadence")."""
    import json
    import time

    from flight.checkpoint.cadence import VISION_RATE_KEY, WriteCosts

    first = flight()
    imgs = [_png(im) for im in make_images()]
    _upload(bus, "first.png", imgs[0])
    seq = bus.command(m.UplinkTask(task_id="t1", prompt="count", images=["first.png"], max_new_tokens=5, priority=1))
    bus.wait_for(lambda h, msg: isinstance(msg, m.Completed) and msg.task_id == "t1" and msg.tc_seq == seq, HANG_S)
    costs = WriteCosts(str(tmp_path / "data" / "state"))
    deadline = time.monotonic() + HANG_S  # kept every marking period (0.25 s here): a bound, not a timing
    while set(costs.load()) != {"vision", "decode", VISION_RATE_KEY}:
        assert time.monotonic() < deadline, "state/write-costs never held both phases and the vision write rate"
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    learned = costs.load()  # what the cut left on disk
    flight()
    bus.wait_for(lambda h, msg: isinstance(msg, m.Heartbeat), HANG_S, start=len(bus.received))

    def loaded():
        for line in (tmp_path / "flight.log").read_text(errors="replace").splitlines():
            if '"write_costs_loaded"' in line:
                return json.loads(line)
        return None

    deadline = time.monotonic() + HANG_S
    while loaded() is None:
        assert time.monotonic() < deadline, "the second boot never logged the write costs it loaded"
        time.sleep(0.1)
    entry = loaded()
    assert entry["vision_s"] == pytest.approx(learned["vision"], abs=1e-6)
    assert entry["decode_s"] == pytest.approx(learned["decode"], abs=1e-6)
    assert entry[f"{VISION_RATE_KEY}_s"] == pytest.approx(learned[VISION_RATE_KEY], abs=1e-6)  # seconds per MiB


def test_a_station_acts_on_its_own_tasks_only(bus, flight):
    """Finding 7c: a station (source >= 0x0010) that did not uplink a task is refused NOT_OWNER
    when it cancels, reprioritises, downlinks or resends it, or releases its quarantine; its owner
    and an admin station (0x0001..0x000F) are not; lists stay open to all; commands and the engine
    are an admin's to release."""
    flight()
    owner, other, admin = 0x0010, 0x0011, 0x0001
    task = m.UplinkTask(task_id="owned", prompt="count the ships", images=[], max_new_tokens=3, priority=1)
    assert isinstance(bus.answer(task, source_id=owner), m.Accepted)
    foreign = [
        m.CancelTask(task_id="owned"),
        m.SetPriority(task_id="owned", priority=9),
        m.DownlinkResult(task_id="owned"),
        task,  # the same uplink again, from someone else
        m.UplinkTask(task_id="owned", prompt="other content", images=[], max_new_tokens=3, priority=1),
        m.ReleaseQuarantine(item="task:owned"),
        m.ReleaseQuarantine(item="engine:load"),
    ]
    for message in foreign:
        report = bus.answer(message, source_id=other)
        assert isinstance(report, m.Rejected) and report.code == ResponseCode.NOT_OWNER, message
    assert isinstance(bus.answer(m.ListQuarantine(), source_id=other), m.Accepted)
    assert isinstance(bus.answer(m.ListLostTasks(), source_id=other), m.Accepted)
    # The owner and an admin are answered on the merits (whatever state the task is in by now).
    for source, message in [
        (owner, task),
        (owner, m.DownlinkResult(task_id="owned")),
        (admin, m.DownlinkResult(task_id="owned")),
        (owner, m.ReleaseQuarantine(item="task:owned")),
        (admin, m.ReleaseQuarantine(item="engine:load")),
        (admin, m.SetPriority(task_id="owned", priority=2)),
        (owner, m.CancelTask(task_id="owned")),
    ]:
        report = bus.answer(message, source_id=source)
        assert getattr(report, "code", None) != ResponseCode.NOT_OWNER, (source, message)
    assert isinstance(bus.answer(task, source_id=owner), m.Accepted), "its own resend stays idempotent"
