"""Bounded fuzzing of the packet decoder: whatever the bytes, decode returns a message or raises
WireError with a real response code, never another exception and never INTERNAL_ERROR (which
would mean the decoder's own safety net caught a defect)."""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_samples import sample_messages  # tests/wire is on sys.path under pytest

from common.wire import Apid, ResponseCode, WireError, decode, encode
from common.wire.messages import all_message_classes
from common.wire.packet import PacketType, crc16, frame

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SAMPLES = sample_messages()
PACKETS = [encode(s, Apid.PAYLOAD, 40000 + i, source_id=1, time_us=0) for i, s in enumerate(SAMPLES)]


def assert_decodes_or_rejects(data: bytes):
    try:
        header, message = decode(data)
    except WireError as err:
        assert err.code != ResponseCode.INTERNAL_ERROR, err.reason
        assert isinstance(err.code, ResponseCode)
        return None
    # Whatever decoded is a valid message: it re-encodes and decodes to the same thing.
    again = decode(
        encode(
            message,
            header.apid,
            header.seq,
            source_id=header.source_id,
            time_us=header.time_us,
            ack_flags=header.ack_flags,
        )
    )
    assert again[1] == message
    return message


def fix_length_and_crc(packet: bytearray) -> bytes:
    """Make a mutated packet pass the length and CRC checks so the mutation reaches the headers
    and body."""
    if len(packet) >= 7:
        packet[4:6] = min(len(packet) - 7, 0xFFFF).to_bytes(2, "big")
    if len(packet) >= 2:
        packet[-2:] = crc16(bytes(packet[:-2])).to_bytes(2, "big")
    return bytes(packet)


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes(data):
    assert_decodes_or_rejects(data)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
)


@FUZZ
@given(st.sampled_from(PACKETS), st.lists(mutation, min_size=1, max_size=4), st.booleans())
def test_mutated_valid_packets(packet, mutations, repair):
    data = bytearray(packet)
    for op, position, arg in mutations:
        i = position % (len(data) + 1) if data else 0
        if op == "flip" and i < len(data):
            data[i] ^= 1 << arg
        elif op == "set" and i < len(data):
            data[i] = arg
        elif op == "insert":
            data[i:i] = arg
        elif op == "delete":
            del data[i : i + arg]
        elif op == "truncate":
            del data[i:]
    assert_decodes_or_rejects(fix_length_and_crc(data) if repair else bytes(data))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)


@st.composite
def perturbed_bodies(draw):
    """A valid message body with one field replaced, dropped or added — the inputs closest to
    valid that the field validation must still sort out."""
    sample = draw(st.sampled_from(SAMPLES))
    body = sample.pack()
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "replace" and body:
        body[draw(st.sampled_from(sorted(body)))] = draw(msgpack_values)
    elif action == "drop" and body:
        del body[draw(st.sampled_from(sorted(body)))]
    else:
        body[draw(st.text(max_size=12))] = draw(msgpack_values)
    return sample, body


@FUZZ
@given(perturbed_bodies())
def test_perturbed_bodies(sample_and_body):
    sample, body = sample_and_body
    packet_type = PacketType.TC if sample.TYPE.is_command else PacketType.TM
    raw = msgpack.packb(body, use_bin_type=True)
    assert_decodes_or_rejects(frame(packet_type, Apid.PAYLOAD, 1, sample.TYPE, raw, time_us=0))


@FUZZ
@given(st.sampled_from(all_message_classes()), msgpack_values, st.booleans())
def test_arbitrary_bodies_for_every_type(cls, body, as_tc):
    raw = msgpack.packb(body, use_bin_type=True)
    assert_decodes_or_rejects(
        frame(PacketType.TC if as_tc else PacketType.TM, Apid.PAYLOAD, 1, cls.TYPE, raw, time_us=0)
    )


@FUZZ
@given(st.sampled_from(all_message_classes()), st.binary(min_size=1, max_size=200))
def test_arbitrary_body_bytes(cls, raw):
    packet_type = PacketType.TC if cls.TYPE.is_command else PacketType.TM
    assert_decodes_or_rejects(frame(packet_type, Apid.PAYLOAD, 1, cls.TYPE, raw, time_us=0))


def test_the_red_team_frame_source():
    """The frames `python -m bench.redteam` feeds the decoder a million of, at a test's size."""
    from hil.redteam import fuzz_decoder

    report = fuzz_decoder(5000, seed=3)
    assert report.passed, report.defects[:5]
    assert report.decoded > 500 and len(report.rejected) > 10
