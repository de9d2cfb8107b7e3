"""Sequence counters and the replay guard, including wrap-around and restarts."""

from __future__ import annotations

import pytest

from common.wire import Apid, ReplayError, ReplayGuard, ResponseCode, SequenceCounter, decode, encode
from common.wire import messages as m
from common.wire.ids import SEQ_MODULUS
from common.wire.seq import DurableSequenceCounter, SequenceStateError, serial_distance

A, G = int(Apid.PAYLOAD), 1  # APID and ground source id


def test_counter_counts_per_apid_and_wraps_the_ccsds_count_into_the_epoch():
    counter = SequenceCounter({A: 16382})
    numbers = [counter.next(A) for _ in range(4)]
    assert numbers == [16382, 16383, 16384, 16385]
    assert counter.next(Apid.BUS) == 0
    packets = [decode(encode(m.Ping(key=1), A, n)) for n in numbers]
    assert [(h.epoch, h.seq_count) for h, _ in packets] == [(0, 16382), (0, 16383), (1, 0), (1, 1)]


def test_counter_wraps_the_30_bit_space():
    counter = SequenceCounter({A: SEQ_MODULUS - 1})
    assert counter.next(A) == SEQ_MODULUS - 1
    assert counter.next(A) == 0


def test_counter_round_trips_and_resyncs_forward_only():
    counter = SequenceCounter({A: 10, int(Apid.BUS): 99})
    clone = SequenceCounter.from_bytes(counter.to_bytes())
    assert clone.peek(A) == 10 and clone.peek(Apid.BUS) == 99
    clone.advance_past(A, 500)
    assert clone.next(A) == 501
    clone.advance_past(A, 5)  # behind: ignored
    assert clone.next(A) == 502


def test_serial_distance():
    assert serial_distance(5, 9) == 4
    assert serial_distance(9, 5) == -4
    assert serial_distance(SEQ_MODULUS - 2, 1) == 3
    assert serial_distance(1, SEQ_MODULUS - 2) == -3


def test_guard_accepts_fresh_and_rejects_replays():
    guard = ReplayGuard()
    for seq in (0, 1, 2, 10):
        guard.accept(A, G, seq)
    for replay in (10, 2, 0):
        with pytest.raises(ReplayError) as info:
            guard.accept(A, G, replay)
        assert info.value.code == ResponseCode.REPLAYED_SEQUENCE
        assert info.value.highest == 10
    guard.accept(A, G, 5)  # late but never seen: accepted once
    with pytest.raises(ReplayError):
        guard.accept(A, G, 5)
    assert guard.highest(A, G) == 10


def test_jump_then_replay_is_refused():
    """The attack a red team found: one accepted jump of 2^29 - 1 made every older number look
    ahead again (serial arithmetic), so a frame captured before the jump was executed again. The
    forward window refuses the jump; walking the window round takes 2^30 / 4096 commands."""
    guard = ReplayGuard()
    captured = encode(m.CancelTask(task_id="t1"), A, 500, source_id=G)
    header, _ = decode(captured)
    guard.accept(header.apid, header.source_id, header.seq)
    for seq in range(501, 600):
        guard.accept(A, G, seq)
    with pytest.raises(ReplayError) as info:
        guard.accept(A, G, 599 + (SEQ_MODULUS // 2) - 1)  # the jump
    assert info.value.code == ResponseCode.SEQUENCE_TOO_FAR_AHEAD and info.value.highest == 599
    assert m.Rejected.from_error(info.value).highest_seq == 599
    with pytest.raises(ReplayError) as info:
        guard.accept(header.apid, header.source_id, header.seq)  # the replay
    assert info.value.code == ResponseCode.REPLAYED_SEQUENCE
    guard.accept(A, G, 599 + 4096)  # the largest jump the window allows is fine ...
    with pytest.raises(ReplayError):
        guard.accept(header.apid, header.source_id, header.seq)  # ... and the old frame stays old


def test_a_ground_far_ahead_rebases_and_is_heard_again(tmp_path):
    guard = ReplayGuard()
    guard.accept(A, G, 10)
    counter = DurableSequenceCounter(tmp_path / "seq.bin")
    counter.rebase(A, 10 + 10_000)  # e.g. many restarts that each skipped a reserved block
    with pytest.raises(ReplayError) as info:
        guard.accept(A, G, counter.next(A))
    counter.rebase(A, info.value.highest)
    guard.accept(A, G, counter.next(A))
    assert guard.highest(A, G) == 11
    assert DurableSequenceCounter(tmp_path / "seq.bin").next(A) > 11  # the rebase is durable


def test_counters_are_thread_safe(tmp_path):
    """A counter shared by threads (the payload's telemetry: main thread and worker) never
    hands out a number twice and never loses its file to a racing writer."""
    import threading

    counter = DurableSequenceCounter(tmp_path / "seq.bin", reserve=2)
    seen, errors = [], []

    def take():
        try:
            seen.extend(counter.next(A) for _ in range(150))
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(seen) == len(set(seen)) == 600


def test_guard_keys_are_apid_and_source():
    guard = ReplayGuard()
    guard.accept(A, 1, 7)
    guard.accept(A, 2, 7)  # another ground station
    guard.accept(int(Apid.BUS), 1, 7)  # another APID
    with pytest.raises(ReplayError):
        guard.accept(A, 2, 7)


def test_guard_window_edge():
    guard = ReplayGuard()
    guard.accept(A, G, 1000)
    guard.accept(A, G, 1000 - 63)  # inside the 64-number window
    with pytest.raises(ReplayError) as info:
        guard.accept(A, G, 1000 - 64)  # too old to tell
    assert "window" in info.value.reason


def test_guard_check_does_not_record():
    guard = ReplayGuard()
    guard.accept(A, G, 3)
    guard.check(A, G, 4)
    guard.check(A, G, 4)
    guard.record(A, G, 4)
    with pytest.raises(ReplayError):
        guard.check(A, G, 4)


@pytest.mark.parametrize("start", [16380, SEQ_MODULUS - 5])
def test_guard_across_wrap_around(start):
    """Across the 14-bit count wrap (epoch increments) and the 30-bit wrap, fresh numbers pass
    and an old packet from before the wrap is still a replay."""
    counter = SequenceCounter({A: start})
    guard = ReplayGuard()
    sent = []
    for _ in range(10):
        header, _ = decode(encode(m.Ping(key=0), A, counter.next(A)))
        guard.accept(header.apid, header.source_id, header.seq)
        sent.append(header.seq)
    assert len(set(s & 0x3FFF for s in sent)) == 10
    for seq in sent:
        with pytest.raises(ReplayError):
            guard.accept(A, 0, seq)


def test_old_command_with_same_ccsds_count_after_a_wrap_is_rejected():
    """A packet captured 16384 commands ago has the same 14-bit count as a fresh one; the epoch
    tells them apart. It is far behind the window, so the guard rejects it."""
    guard = ReplayGuard()
    old = encode(m.CancelTask(task_id="t1"), A, 100, source_id=G)
    header, _ = decode(old)
    guard.accept(header.apid, header.source_id, header.seq)
    for seq in range(100 + 4096, 100 + 16384, 4096):  # 16383 commands later, in steps the window allows
        guard.accept(A, G, seq)
    guard.accept(A, G, 100 + 16384 - 1)
    assert header.seq_count == (100 + 16384) & 0x3FFF
    with pytest.raises(ReplayError):
        header, _ = decode(old)
        guard.accept(header.apid, header.source_id, header.seq)
    guard.accept(A, G, 100 + 16384)  # the fresh packet with that count passes


def test_guard_state_survives_a_reboot(tmp_path):
    path = tmp_path / "flight" / "replay-guard.bin"
    guard = ReplayGuard()
    for seq in (1, 2, 3, 9, 40):
        guard.accept(A, G, seq)
    guard.accept(int(Apid.BUS), 7, 123)
    guard.save(path)
    rebooted = ReplayGuard.load(path)  # the flight process after a power cut
    assert rebooted.to_bytes() == guard.to_bytes()
    for seq in (1, 9, 40):
        with pytest.raises(ReplayError):
            rebooted.accept(A, G, seq)
    rebooted.accept(A, G, 39)  # never seen, inside the window
    rebooted.accept(A, G, 41)
    with pytest.raises(ReplayError):
        rebooted.accept(int(Apid.BUS), 7, 123)


def test_guard_from_bytes_round_trip_keeps_windows():
    guard = ReplayGuard()
    for seq in range(0, 200, 3):
        guard.accept(A, G, seq)
    clone = ReplayGuard.from_bytes(guard.to_bytes())
    for seq in range(140, 200):
        fresh = seq % 3 != 0
        if fresh:
            clone.check(A, G, seq)
        else:
            with pytest.raises(ReplayError):
                clone.check(A, G, seq)


def test_missing_guard_file_is_an_empty_guard(tmp_path):
    guard = ReplayGuard.load(tmp_path / "none.bin")
    guard.accept(A, G, 12345)


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic"])
def test_damaged_state_is_refused(damage):
    guard = ReplayGuard()
    guard.accept(A, G, 5)
    data = bytearray(guard.to_bytes())
    if damage == "flip":
        data[10] ^= 0x01
    elif damage == "truncate":
        data = data[:-3]
    else:
        data = bytearray(SequenceCounter({A: 1}).to_bytes())
    with pytest.raises(SequenceStateError):
        ReplayGuard.from_bytes(bytes(data))


def test_durable_counter_never_reuses_a_number_across_restarts(tmp_path):
    path = tmp_path / "keys" / "state" / "tc-sequence.bin"
    first = DurableSequenceCounter(path, reserve=8)
    issued = [first.next(A) for _ in range(11)]
    assert issued == list(range(11))
    # A restart (or a crash right after the last next()) resumes past every issued number.
    second = DurableSequenceCounter(path, reserve=8)
    resumed = second.next(A)
    assert resumed > issued[-1]
    assert resumed - issued[-1] <= 8
    third = DurableSequenceCounter(path, reserve=8)
    assert third.next(A) > resumed


def test_durable_counter_writes_once_per_block(tmp_path):
    writes = []

    from common.durable import DurableFS

    class CountingFS(DurableFS):
        def write_atomic(self, path, chunks):
            writes.append(path)
            return super().write_atomic(path, chunks)

    counter = DurableSequenceCounter(tmp_path / "seq.bin", reserve=16, fs=CountingFS())
    for _ in range(40):
        counter.next(A)
    assert len(writes) == 3  # blocks starting at 0, 16, 32


def test_ground_restart_with_guard_on_the_payload(tmp_path):
    """End to end: commands from a ground that restarts are all fresh to the payload."""
    guard = ReplayGuard()
    seq_path = tmp_path / "tc-sequence.bin"
    for _session in range(3):
        counter = DurableSequenceCounter(seq_path, reserve=4)
        for _ in range(5):
            header, _ = decode(encode(m.Ping(key=1), A, counter.next(A), source_id=G))
            guard.accept(header.apid, header.source_id, header.seq)


def test_resync_after_lost_ground_state(tmp_path):
    """A ground whose state was wiped is told the payload's highest number and moves past it."""
    guard = ReplayGuard()
    for seq in range(50):
        guard.accept(A, G, seq)
    counter = DurableSequenceCounter(tmp_path / "fresh.bin")
    with pytest.raises(ReplayError) as info:
        guard.accept(A, G, counter.next(A))
    report = m.Rejected.from_error(info.value)
    assert report.highest_seq == 49
    counter.advance_past(A, report.highest_seq)
    guard.accept(A, G, counter.next(A))
