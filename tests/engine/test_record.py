"""The record format (docs/record-format.md) round-trips and rejects every kind of damage."""

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.record import (
    FOOTER_LEN,
    Kind,
    RecordError,
    decode,
    encode,
    iter_records,
    masked_crc,
    read_partial,
)


def _sample():
    torch.manual_seed(0)
    return {
        "k.0": torch.randn(1, 2, 5, 8),
        "v.0": torch.randn(1, 2, 5, 8).to(torch.bfloat16),
        "tokens": torch.arange(5),
        "hidden": torch.randn(5, 16),
    }


def test_round_trip_and_alignment():
    tensors = _sample()
    enc = encode(Kind.PREFILL_BLOCK, {"group": 1, "chunk": 2}, tensors, salt=99)
    data = bytearray(enc.to_bytes())
    assert len(data) == enc.nbytes
    rec, n = decode(data)
    assert n == len(data) and rec.kind == Kind.PREFILL_BLOCK and rec.salt == 99 and rec.meta["chunk"] == 2
    for name, t in tensors.items():
        assert rec.tensors[name].dtype == t.dtype and torch.equal(rec.tensors[name], t)
    assert data[:4] == b"OWR1" and data[-4:] == b"OWC!"


def test_every_truncation_and_every_bit_flip_is_rejected():
    data = encode(Kind.DECODE_STEPS, {"step_start": 0}, {"t": torch.arange(6)}, salt=1).to_bytes()
    for cut in range(len(data)):
        with pytest.raises(RecordError):
            decode(bytearray(data[:cut]))
    for i in range(len(data)):
        for bit in (0, 7):
            damaged = bytearray(data)
            damaged[i] ^= 1 << bit
            with pytest.raises(RecordError):
                decode(damaged)


def test_appended_records_stop_at_the_first_bad_one():
    a = encode(Kind.DECODE_STEPS, {"i": 0}, {"t": torch.arange(3)}).to_bytes()
    b = encode(Kind.DECODE_STEPS, {"i": 1}, {"t": torch.arange(4)}).to_bytes()
    c = encode(Kind.DECODE_STEPS, {"i": 2}, {"t": torch.arange(5)}).to_bytes()
    log = bytearray(a + b[:-3] + c)
    assert [r.meta["i"] for r, _, _ in iter_records(log)] == [0]


def test_partial_read_verifies_what_it_reads():
    tensors = _sample()
    data = encode(Kind.PREFILL_BLOCK, {}, tensors).to_bytes()
    rec = read_partial(io.BytesIO(data), {"k.0"}, len(data))
    assert set(rec.tensors) == {"k.0"} and torch.equal(rec.tensors["k.0"], tensors["k.0"])
    damaged = bytearray(data)
    damaged[-FOOTER_LEN - 8] ^= 0xFF  # inside the last tensor ("hidden")
    read_partial(io.BytesIO(bytes(damaged)), {"k.0"}, len(damaged))  # untouched part still fine
    with pytest.raises(RecordError, match="tensor_crc"):
        read_partial(io.BytesIO(bytes(damaged)), {"hidden"}, len(damaged))


def test_masked_crc_matches_leveldb_definition():
    import crc32c

    data = b"orbitweaver"
    crc = crc32c.crc32c(data)
    assert masked_crc(data) == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.int8]),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
        ),
        max_size=4,
    ),
    st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1), max_size=3),
)
def test_round_trip_property(specs, extra):
    tensors = {f"t{i}": torch.zeros(shape, dtype=dt).random_(0, 7) for i, (dt, shape) in enumerate(specs)}
    meta = {f"m_{k}": v for k, v in extra.items()}
    data = bytearray(encode(Kind.RESULT, meta, tensors, salt=5).to_bytes())
    rec, _ = decode(data)
    assert all(torch.equal(rec.tensors[k], v) for k, v in tensors.items())
    assert all(rec.meta[k] == v for k, v in meta.items())
