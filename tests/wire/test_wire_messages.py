"""Round trips for every message type, and the helpers messages offer."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.wire import Apid, MessageType, NodeId, ResponseCode, WireError, decode, encode
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.ids import AckFlags, EventId, Severity, TlmChannel
from common.wire.packet import PacketType, frame


def test_every_message_type_has_a_sample(all_samples):
    assert {s.TYPE for s in all_samples} == set(MessageType)
    assert [c.TYPE for c in m.all_message_classes()] == sorted(MessageType)


def test_pack_unpack_round_trip(sample):
    body = sample.pack()
    # The body survives msgpack exactly as the wire carries it.
    wire_body = msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)
    assert type(sample).unpack(wire_body) == sample


def test_encode_decode_round_trip(sample):
    seq = (3 << 14) | 16383  # a count about to wrap, in epoch 3
    packet = encode(sample, Apid.PAYLOAD, seq, source_id=NodeId.GROUND, time_us=1_700_000_000_123_456)
    header, decoded = decode(packet)
    assert decoded == sample
    assert type(decoded) is type(sample)
    assert header.apid == Apid.PAYLOAD
    assert header.seq == seq and header.seq_count == 16383 and header.epoch == 3
    assert header.message_type == sample.TYPE
    assert header.source_id == NodeId.GROUND
    assert header.time_us == 1_700_000_000_123_456
    assert header.length == len(packet)
    assert (header.packet_type == 1) == sample.TYPE.is_command
    assert header.ack_flags == (AckFlags.ALL if sample.TYPE.is_command else AckFlags.NONE)


def test_ack_flags_travel_with_commands():
    packet = encode(m.Ping(key=1), Apid.PAYLOAD, 0, ack_flags=AckFlags.ACCEPTANCE | AckFlags.COMPLETION)
    header, _ = decode(packet)
    assert header.wants(AckFlags.ACCEPTANCE) and header.wants(AckFlags.COMPLETION)
    assert not header.wants(AckFlags.PROGRESS)


def test_image_split_reassembles_and_checks():
    content = hashlib.sha256(b"x").digest() * 1000  # 32000 bytes
    chunks = m.ImageChunk.split("scene.jpg", content, chunk_bytes=7000)
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert {c.total for c in chunks} == {5}
    assert b"".join(c.data for c in sorted(chunks, key=lambda c: c.offset)) == content
    m.check_file_hash(content, chunks[-1].sha256)  # no exception
    with pytest.raises(WireError) as info:
        m.check_file_hash(content[:-1] + b"\x00", chunks[0].sha256, "scene.jpg")
    assert info.value.code == ResponseCode.FILE_HASH_MISMATCH


def test_image_split_refuses_oversized_image():
    with pytest.raises(WireError) as info:
        m.ImageChunk.split("big", b"\x00" * (16 * 1024 * 1024 + 1), chunk_bytes=60 * 1024)
    assert info.value.code == ResponseCode.IMAGE_TOO_LARGE


def test_image_status_bitmap():
    status = m.ImageStatus.of("img", image_size=1000, total=10, received_indices=[0, 1, 9])
    assert status.received == bytes([0b0000_0011, 0b0000_0010])
    assert status.missing() == [2, 3, 4, 5, 6, 7, 8]
    assert not status.complete
    full = m.ImageStatus.of("img", image_size=1000, total=10, received_indices=range(10), verified=True)
    assert full.complete and full.missing() == []
    unknown = m.ImageStatus.of("img", image_size=0, total=0, received_indices=[])
    assert not unknown.complete and unknown.received == b""
    with pytest.raises(WireError) as info:
        m.ImageStatus(image="img", image_size=10, total=3, received=b"\x08", verified=False)
    assert info.value.code == ResponseCode.BAD_FIELD_VALUE  # bit 3 set but only 3 chunks


def test_event_severity_comes_from_the_table():
    event = m.Event(event_id=EventId.TASK_FAILED, text="boom")
    assert event.severity == Severity.WARNING_HI == EventId.TASK_FAILED.severity
    assert event.pack()["severity"] == int(Severity.WARNING_HI)
    with pytest.raises(WireError) as info:
        m.Event(event_id=EventId.TASK_FAILED, text="boom", severity=Severity.DIAGNOSTIC)
    assert info.value.code == ResponseCode.BAD_FIELD_VALUE


def test_every_event_has_an_fprime_severity():
    assert all(isinstance(e.severity, Severity) for e in EventId)


def test_housekeeping_channels(all_samples):
    hk = next(s for s in all_samples if isinstance(s, m.Housekeeping))
    channels = hk.channels()
    assert channels[TlmChannel.QUEUE_DEPTH] == hk.queue_depth
    assert channels[TlmChannel.DISK_FREE_BYTES] == hk.disk_free_bytes
    assert channels[TlmChannel.STORAGE_STATE] == hk.storage_state
    assert channels[TlmChannel.MEMORY_RSS] == hk.memory_rss_bytes
    assert channels[TlmChannel.STORAGE_WRITTEN] == hk.written_bytes
    assert len(channels) == 16


def test_housekeeping_without_the_later_fields_still_decodes(all_samples):
    """An older payload's HOUSEKEEPING (or one kept in an older log) has no memory_rss_bytes or
    written_bytes: it decodes, and both read as None ("not reported"), never as a zero."""
    hk = next(s for s in all_samples if isinstance(s, m.Housekeeping))
    assert hk.memory_rss_bytes is not None and hk.written_bytes is not None
    old_body = {k: v for k, v in hk.pack().items() if k not in ("memory_rss_bytes", "written_bytes")}
    packet = frame(PacketType.TM, Apid.PAYLOAD, 5, MessageType.HOUSEKEEPING, msgpack.packb(old_body), source_id=0x0200)
    _, decoded = decode(packet)
    assert decoded.memory_rss_bytes is None and decoded.written_bytes is None
    assert decoded.queue_depth == hk.queue_depth and decoded.reserve_bytes == hk.reserve_bytes
    # and the new ones travel bit for bit
    assert decode(encode(hk, Apid.PAYLOAD, 6))[1] == hk


def test_task_result_without_the_later_fields_still_decodes(all_samples):
    """An older payload's TASK_RESULT has no recovery_* or written_bytes: it decodes, and they
    read as None ("not reported"), never as "no restart" or zero bytes; the new ones travel."""
    result = next(s for s in all_samples if isinstance(s, m.TaskResult))
    later = ("recovery_s", "recovery_phases", "recovery_planners", "written_bytes")
    assert all(getattr(result, name) is not None for name in later)
    assert result.recoveries == [(0.0125, "prefill", "optimal"), (0.5, "decode", "layer-first")]
    old_body = {k: v for k, v in result.pack().items() if k not in later}
    packet = frame(PacketType.TM, Apid.PAYLOAD, 5, MessageType.TASK_RESULT, msgpack.packb(old_body), source_id=0x0200)
    _, decoded = decode(packet)
    assert all(getattr(decoded, name) is None for name in later) and decoded.recoveries is None
    assert decoded.token_ids == result.token_ids and decoded.interruptions == result.interruptions
    assert decode(encode(result, Apid.PAYLOAD, 6))[1] == result
    # a task never restarted: three empty arrays, not nil
    fresh = m.TaskResult(**{**_fields(result), "recovery_s": [], "recovery_phases": [], "recovery_planners": []})
    assert decode(encode(fresh, Apid.PAYLOAD, 7))[1].recoveries == []


@pytest.mark.parametrize(
    "change",
    [{"recovery_phases": None}, {"recovery_planners": ["optimal"]}, {"recovery_s": [0.1, 0.2, 0.3]}],
)
def test_task_result_recovery_arrays_come_together(all_samples, change):
    result = next(s for s in all_samples if isinstance(s, m.TaskResult))
    with pytest.raises(WireError) as info:
        m.TaskResult(**{**_fields(result), **change})
    assert info.value.code == ResponseCode.BAD_FIELD_VALUE and "of one length" in str(info.value)


def _fields(message) -> dict:
    return {field.name: getattr(message, field.name) for field in dataclasses.fields(message)}


def test_rejected_from_error_names_the_command():
    packet = encode(
        m.UplinkTask(task_id="t", prompt="p", images=[], max_new_tokens=1, priority=0), Apid.PAYLOAD, 77, source_id=2
    )
    damaged = bytearray(packet)
    damaged[-5] ^= 0xFF
    with pytest.raises(WireError) as info:
        decode(bytes(damaged))
    report = m.Rejected.from_error(info.value)
    assert report.code == ResponseCode.BAD_CRC
    assert report.request == RequestRef(apid=Apid.PAYLOAD, source_id=2, seq=77, message_type=MessageType.UPLINK_TASK)
    # and the report itself travels
    assert decode(encode(report, Apid.PAYLOAD, 0))[1] == report


def test_rejected_from_error_without_request():
    with pytest.raises(WireError) as info:
        decode(b"\x18")
    report = m.Rejected.from_error(info.value)
    assert (report.tc_apid, report.tc_seq, report.code) == (0, 0, ResponseCode.MALFORMED_PACKET)


def test_messages_are_immutable(all_samples):
    for sample in all_samples:
        for field in sample.pack():
            with pytest.raises(AttributeError):
                setattr(sample, field, None)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.integers(0, 600))
def test_clip_utf8_bounds_bytes_without_splitting_a_character(text, limit):
    """Finding 2: reasons and texts were cut by characters and overflowed their byte fields (a
    FAILED report then failed its own encoding, at every boot). One helper cuts by bytes."""
    from common.wire.text import clip_utf8

    clipped = clip_utf8(text, limit)
    data = clipped.encode("utf-8")  # never a lone surrogate, never a split character
    assert len(data) <= limit
    if len(text.encode("utf-8", "replace")) <= limit:
        assert clipped == text.encode("utf-8", "replace").decode("utf-8")
    elif limit >= 3:
        assert clipped.endswith("...") and text.encode("utf-8", "replace").decode().startswith(clipped[:-3])


def test_every_bounded_text_field_takes_a_clipped_value():
    from common.wire.ids import MAX_EVENT_TEXT_BYTES, MAX_REASON_BYTES, MAX_RESULT_TEXT_BYTES
    from common.wire.text import clip_utf8

    long = "é☁" * 40000
    m.Event(event_id=1, text=clip_utf8(long, MAX_EVENT_TEXT_BYTES))
    m.Failed(tc_apid=32, tc_source=1, tc_seq=1, tc_type=272, code=600, reason=clip_utf8(long, MAX_REASON_BYTES))
    m.TaskResult(
        task_id="t", token_ids=[], text=clip_utf8(long, MAX_RESULT_TEXT_BYTES), logits_sha256=b"\0" * 32, timings={}
    )
    m.FdirReport(trace_time_s=0.0, mode="safe", fault_count=1, last_fault=clip_utf8(long, MAX_EVENT_TEXT_BYTES))


# ---- what the ground shows, and what is blank (issue 27, finding 9) ------------------------------

BIDI_CONTROLS = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u061c\u200e\u200f"
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff"


def test_display_text_escapes_controls_bidi_and_zero_width_characters_visibly():
    from common.wire.text import display_text

    assert display_text("report\u202etxt.exe") == "report\\u202etxt.exe"
    assert display_text("a\x1b[2Jb\rc\nd\te\x00\x9b") == "a\\x1b[2Jb\\rc\\nd\\te\\x00\\x9b"
    assert display_text("tag \U000e0041") == "tag \\U000e0041"
    for ch in BIDI_CONTROLS + ZERO_WIDTH + "\u2028\u2029\u3164":
        assert display_text(ch) == f"\\u{ord(ch):04x}"
    assert display_text("soft\u00adhyphen") == "soft\\xadhyphen"
    # a block keeps its line feeds and tabs, nothing else
    assert display_text("one\ntwo\tthree\r\u202e", keep_newlines=True) == "one\ntwo\tthree\\r\\u202e"
    # visible text, non-ASCII included, is shown as it is
    for text in ("two ships, one bridge", "café ☁ 船 \u05e9\u05dc\u05d5\u05dd", "❤\ufe0f", "a\\u202e"):
        assert display_text(text) == text


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.booleans())
def test_nothing_hidden_survives_display_text(text, keep_newlines):
    from common.wire.text import display_text, is_hidden

    shown = display_text(text, keep_newlines=keep_newlines)
    assert all(not is_hidden(ch) or (keep_newlines and ch in "\n\t") for ch in shown)
    shown.encode("utf-8")  # printable: no lone surrogate left (this would raise)
    if not any(is_hidden(ch) for ch in text):
        assert shown == text


def test_is_blank_is_no_visible_character():
    from common.wire.text import is_blank

    for text in ("", " \n\t", "\x00\x00", ZERO_WIDTH, BIDI_CONTROLS, "\u3000\u00a0", "\ufe0f\u034f\u2800", "\u3164"):
        assert is_blank(text), repr(text)
    for text in ("a", "\u200ba", " .", "\u05e9", "船", "❤", "\x00?", "\u0301"):
        assert not is_blank(text), repr(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_one_blank_rule_on_the_ground_and_on_the_wire(text):
    """The ground's local check and the wire's UPLINK_TASK validation (what the payload decodes)
    refuse exactly the same prompts: `common.wire.text.is_blank`."""
    from common.wire.text import is_blank
    from ground.errors import LocalInputError
    from ground.images import check_prompt

    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates: INVALID_UTF8 on both sides, another rule
    try:
        check_prompt(text)
        ground_refuses = False
    except LocalInputError:
        ground_refuses = True
    try:
        m.UplinkTask(task_id="t", prompt=text, images=[], max_new_tokens=1, priority=0)
        wire_code = None
    except WireError as exc:
        wire_code = exc.code
    assert ground_refuses == is_blank(text)
    assert (wire_code is not None) == is_blank(text)
    if text and is_blank(text):
        assert wire_code == ResponseCode.EMPTY_PROMPT
