"""Each class of bad input is rejected by decode with its own response code."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from common.wire import Apid, MessageType, ResponseCode, WireError, decode
from common.wire import messages as m
from common.wire.ids import MAX_PACKET_BYTES
from common.wire.packet import PacketType, crc16, encode, frame

DROP = object()


def body_packet(body: object, message_type: int = MessageType.UPLINK_TASK, packet_type=PacketType.TC, **kw) -> bytes:
    raw = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return frame(packet_type, Apid.PAYLOAD, 1, message_type, raw, source_id=1, time_us=0, **kw)


def uplink(**changes) -> bytes:
    body = {"task_id": "t1", "prompt": "Describe.", "images": ["img1"], "max_new_tokens": 16, "priority": 1}
    body.update(changes)
    return body_packet({k: v for k, v in body.items() if v is not DROP})


def chunk(**changes) -> bytes:
    data = b"chunk-data"
    body = {
        "image": "img1",
        "index": 0,
        "total": 2,
        "offset": 0,
        "image_size": 20,
        "data": data,
        "crc32c": m.crc32c(data),
        "sha256": hashlib.sha256(b"x").digest(),
    }
    body.update(changes)
    return body_packet({k: v for k, v in body.items() if v is not DROP}, MessageType.IMAGE_CHUNK)


def recrc(packet: bytes | bytearray) -> bytes:
    """Fix the CRC after editing header bits, so that the edit itself is what gets checked."""
    packet = bytearray(packet)
    packet[-2:] = crc16(bytes(packet[:-2])).to_bytes(2, "big")
    return bytes(packet)


def edit(packet: bytes, offset: int, fn) -> bytes:
    changed = bytearray(packet)
    changed[offset] = fn(changed[offset])
    return recrc(changed)


def utf8_broken(key_or_value: str) -> bytes:
    """An UPLINK_TASK whose prompt value (or a key) holds invalid UTF-8 bytes in a msgpack str."""
    body = {"task_id": "t1", "prompt": "PLACEHOLDER", "images": [], "max_new_tokens": 1, "priority": 1}
    if key_or_value == "key":
        body["PLACEHOLDER"] = body.pop("prompt")
    raw = msgpack.packb(body, use_bin_type=True).replace(b"PLACEHOLDER", b"\xff\xfeBAD\xc3(\xa0\xa1xx")
    return body_packet(raw)


VALID = uplink()

CASES = [
    # packet layer
    ("not-bytes", lambda: "a string", ResponseCode.MALFORMED_PACKET),
    ("empty", lambda: b"", ResponseCode.MALFORMED_PACKET),
    ("shorter-than-primary-header", lambda: VALID[:5], ResponseCode.MALFORMED_PACKET),
    ("headers-only", lambda: recrc(bytes.fromhex("1820c001000d") + bytes(14)), ResponseCode.MALFORMED_PACKET),
    ("oversized", lambda: VALID + bytes(MAX_PACKET_BYTES), ResponseCode.OVERSIZED_PACKET),
    ("trailing-byte", lambda: VALID + b"\x00", ResponseCode.BAD_LENGTH),
    ("truncated", lambda: VALID[:-1], ResponseCode.BAD_LENGTH),
    ("body-bit-flip", lambda: edit(VALID, 30, lambda b: b ^ 0x01)[:-2] + VALID[-2:], ResponseCode.BAD_CRC),
    ("crc-bit-flip", lambda: VALID[:-1] + bytes([VALID[-1] ^ 0x80]), ResponseCode.BAD_CRC),
    ("ccsds-version-1", lambda: edit(VALID, 0, lambda b: b | 0x20), ResponseCode.BAD_VERSION),
    ("wire-version-2", lambda: body_packet({}, MessageType.STATUS, wire_version=2), ResponseCode.BAD_VERSION),
    ("no-secondary-header-flag", lambda: edit(VALID, 0, lambda b: b & ~0x08), ResponseCode.MALFORMED_PACKET),
    ("segmented", lambda: edit(VALID, 2, lambda b: b & 0x3F), ResponseCode.MALFORMED_PACKET),
    ("reserved-ack-bits", lambda: body_packet({}, MessageType.STATUS, ack_flags=0x10), ResponseCode.MALFORMED_PACKET),
    (
        "ack-flags-in-tm",
        lambda: body_packet({"key": 1}, MessageType.PONG, PacketType.TM, ack_flags=1),
        ResponseCode.MALFORMED_PACKET,
    ),
    ("unknown-command", lambda: body_packet({}, 0x01FF), ResponseCode.UNKNOWN_COMMAND),
    ("unknown-telemetry", lambda: body_packet({}, 0x03FF, PacketType.TM), ResponseCode.UNKNOWN_MESSAGE_TYPE),
    (
        "command-in-tm-packet",
        lambda: body_packet({"key": 1}, MessageType.PING, PacketType.TM),
        ResponseCode.WRONG_PACKET_TYPE,
    ),
    (
        "telemetry-in-tc-packet",
        lambda: body_packet({"key": 1}, MessageType.PONG, PacketType.TC),
        ResponseCode.WRONG_PACKET_TYPE,
    ),
    # body
    ("msgpack-reserved-byte", lambda: body_packet(b"\xc1"), ResponseCode.BODY_UNDECODABLE),
    ("msgpack-truncated", lambda: body_packet(b"\x82\xa1a"), ResponseCode.BODY_UNDECODABLE),
    ("msgpack-two-objects", lambda: body_packet(b"\x80\x80", MessageType.STATUS), ResponseCode.BODY_UNDECODABLE),
    ("body-not-a-map", lambda: body_packet([1, 2, 3]), ResponseCode.BODY_UNDECODABLE),
    ("map-key-not-string", lambda: body_packet(b"\x81\x01\x02", MessageType.STATUS), ResponseCode.BODY_UNDECODABLE),
    ("missing-prompt", lambda: uplink(prompt=DROP), ResponseCode.MISSING_FIELD),
    ("missing-chunk-sha256", lambda: chunk(sha256=DROP), ResponseCode.MISSING_FIELD),
    ("unexpected-field", lambda: uplink(dry_run=True), ResponseCode.UNEXPECTED_FIELD),
    ("bytes-key", lambda: body_packet({b"key": 1}, MessageType.PING), ResponseCode.UNEXPECTED_FIELD),
    ("int-as-string", lambda: uplink(max_new_tokens="16"), ResponseCode.BAD_FIELD_TYPE),
    ("bool-as-int", lambda: uplink(priority=True), ResponseCode.BAD_FIELD_TYPE),
    ("string-not-list", lambda: uplink(images="img1"), ResponseCode.BAD_FIELD_TYPE),
    ("prompt-as-bin", lambda: uplink(prompt=b"Describe."), ResponseCode.BAD_FIELD_TYPE),
    ("chunk-data-as-str", lambda: chunk(data="chunk-data"), ResponseCode.BAD_FIELD_TYPE),
    ("nil-required", lambda: uplink(task_id=None), ResponseCode.BAD_FIELD_TYPE),
    ("zero-tokens", lambda: uplink(max_new_tokens=0), ResponseCode.BAD_FIELD_VALUE),
    ("negative-priority", lambda: uplink(priority=-1), ResponseCode.BAD_FIELD_VALUE),
    ("priority-256", lambda: uplink(priority=256), ResponseCode.BAD_FIELD_VALUE),
    ("empty-prompt", lambda: uplink(prompt=""), ResponseCode.BAD_FIELD_VALUE),
    ("duplicate-images", lambda: uplink(images=["a", "a"]), ResponseCode.BAD_FIELD_VALUE),
    ("bad-sha256-length", lambda: chunk(sha256=b"\x00" * 31), ResponseCode.BAD_FIELD_VALUE),
    ("prompt-too-long", lambda: uplink(prompt="é" * 4097), ResponseCode.FIELD_TOO_LONG),
    ("too-many-images", lambda: uplink(images=[f"i{n}" for n in range(9)]), ResponseCode.FIELD_TOO_LONG),
    ("invalid-utf8-value", lambda: utf8_broken("value"), ResponseCode.INVALID_UTF8),
    ("invalid-utf8-key", lambda: utf8_broken("key"), ResponseCode.INVALID_UTF8),
    ("dotdot-task-id", lambda: uplink(task_id="../etc"), ResponseCode.PATH_LIKE_NAME),
    ("slash-image", lambda: uplink(images=["a/b"]), ResponseCode.PATH_LIKE_NAME),
    ("backslash-image", lambda: uplink(images=["a\\b"]), ResponseCode.PATH_LIKE_NAME),
    ("nul-task-id", lambda: uplink(task_id="a\x00b"), ResponseCode.PATH_LIKE_NAME),
    ("hidden-task-id", lambda: uplink(task_id=".hidden"), ResponseCode.PATH_LIKE_NAME),
    ("drive-image", lambda: chunk(image="C:evil"), ResponseCode.PATH_LIKE_NAME),
    ("home-image", lambda: chunk(image="~root"), ResponseCode.PATH_LIKE_NAME),
    ("empty-name", lambda: uplink(task_id=""), ResponseCode.BAD_NAME),
    ("space-in-name", lambda: uplink(task_id="has space"), ResponseCode.BAD_NAME),
    ("non-ascii-name", lambda: uplink(task_id="tâche"), ResponseCode.BAD_NAME),
    ("name-too-long", lambda: uplink(task_id="x" * 65), ResponseCode.BAD_NAME),
    # images
    ("image-too-large", lambda: chunk(image_size=16 * 1024 * 1024 + 1), ResponseCode.IMAGE_TOO_LARGE),
    ("chunk-crc", lambda: chunk(crc32c=0x12345678), ResponseCode.CHUNK_CRC_MISMATCH),
    ("chunk-index-past-total", lambda: chunk(index=2), ResponseCode.CHUNK_OUT_OF_RANGE),
    ("chunk-bytes-past-end", lambda: chunk(offset=15), ResponseCode.CHUNK_OUT_OF_RANGE),
]


@pytest.mark.parametrize("make, code", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_rejected_with_its_code(make, code):
    with pytest.raises(WireError) as info:
        decode(make())
    assert info.value.code == code, info.value.reason
    assert info.value.reason.isascii() and len(info.value.reason) <= 256


def test_valid_baselines_decode():
    """The builders above make valid packets when nothing is changed, so each case fails only
    because of its own defect."""
    assert isinstance(decode(uplink())[1], m.UplinkTask)
    assert isinstance(decode(chunk())[1], m.ImageChunk)
    assert isinstance(decode(body_packet({}, MessageType.STATUS))[1], m.Status)
    assert isinstance(decode(recrc(VALID))[1], m.UplinkTask)


def test_every_decode_code_is_exercised():
    decode_codes = {
        ResponseCode.MALFORMED_PACKET,
        ResponseCode.OVERSIZED_PACKET,
        ResponseCode.BAD_LENGTH,
        ResponseCode.BAD_CRC,
        ResponseCode.BAD_VERSION,
        ResponseCode.WRONG_PACKET_TYPE,
        ResponseCode.UNKNOWN_COMMAND,
        ResponseCode.UNKNOWN_MESSAGE_TYPE,
        ResponseCode.BODY_UNDECODABLE,
        ResponseCode.MISSING_FIELD,
        ResponseCode.UNEXPECTED_FIELD,
        ResponseCode.BAD_FIELD_TYPE,
        ResponseCode.BAD_FIELD_VALUE,
        ResponseCode.FIELD_TOO_LONG,
        ResponseCode.INVALID_UTF8,
        ResponseCode.PATH_LIKE_NAME,
        ResponseCode.BAD_NAME,
        ResponseCode.IMAGE_TOO_LARGE,
        ResponseCode.CHUNK_CRC_MISMATCH,
        ResponseCode.CHUNK_OUT_OF_RANGE,
    }
    assert {c[2] for c in CASES} == decode_codes


#: prompts with no visible character (issue 27, finding 9): each was accepted as non-blank
BLANK_PROMPTS = {
    "nuls": "\x00\x00\x00",
    "zero-width": "\u200b\u200c\u200d\u2060\ufeff",
    "bidi-controls": "\u202e\u202d\u202a\u202b\u202c\u2066\u2067\u2068\u2069\u061c\u200e\u200f",
    "controls": "\x1b\x07\x7f\x85\x9b",
    "mixed": " \u200b\t\x00\u00ad\u2028\ufe0f\u3164 ",
}


@pytest.mark.parametrize("prompt", list(BLANK_PROMPTS.values()), ids=list(BLANK_PROMPTS))
def test_a_prompt_with_no_visible_character_is_refused_at_decoding(prompt):
    with pytest.raises(WireError) as info:
        decode(uplink(prompt=prompt))
    assert info.value.code == ResponseCode.EMPTY_PROMPT and info.value.field == "prompt"
    # one visible character among the same ones is a prompt
    assert decode(uplink(prompt=prompt + "?"))[1].prompt == prompt + "?"


def test_rejection_carries_the_request_and_header():
    packet = frame(
        PacketType.TC,
        Apid.PAYLOAD,
        (2 << 14) | 9,
        MessageType.UPLINK_TASK,
        msgpack.packb({"task_id": "../x"}),
        source_id=4,
        time_us=0,
    )
    with pytest.raises(WireError) as info:
        decode(packet)
    err = info.value
    assert err.code == ResponseCode.MISSING_FIELD
    assert err.request.apid == Apid.PAYLOAD and err.request.seq == (2 << 14) | 9 and err.request.source_id == 4
    assert err.header is not None and err.header.epoch == 2


def test_oversized_body_refused_at_encode():
    with pytest.raises(WireError) as info:
        frame(PacketType.TM, Apid.PAYLOAD, 0, MessageType.PONG, bytes(MAX_PACKET_BYTES))
    assert info.value.code == ResponseCode.OVERSIZED_PACKET


def test_python_construction_validates_too():
    with pytest.raises(WireError) as info:
        m.UplinkTask(task_id="t", prompt="\udc80", images=[], max_new_tokens=1, priority=0)
    assert info.value.code == ResponseCode.INVALID_UTF8
    with pytest.raises(WireError) as info:
        m.CancelTask(task_id="a/../b")
    assert info.value.code == ResponseCode.PATH_LIKE_NAME


def test_encode_rejects_out_of_range_addressing():
    with pytest.raises(ValueError):
        encode(m.Ping(key=1), 0x800, 0)
    with pytest.raises(ValueError):
        encode(m.Ping(key=1), Apid.PAYLOAD, 1 << 30)
