"""Bad input to the real payload process: each class is rejected with its own code, the process
keeps running, and the queue is intact."""

import hashlib
import json
import os
import signal
import subprocess
import sys

import msgpack
import pytest
from testkit import HANG_S

from common.wire import Apid, MessageType, NodeId, ResponseCode, encode
from common.wire import messages as m
from common.wire.packet import PacketType, frame
from hil.scripted_bus import BusPeer, spawn_flight


@pytest.fixture
def payload(tmp_path, model_dirs):
    bus = BusPeer(str(tmp_path / "keys"))
    proc = spawn_flight(
        tmp_path / "data", model_dirs["qwen3-vl"], tmp_path / "keys", bus.endpoint, log_path=tmp_path / "flight.log"
    )
    bus.wait_connected()
    yield bus, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    bus.close()


def _tc(bus, message_type, body) -> tuple[bytes, int]:
    seq = bus.counter.next(Apid.PAYLOAD)
    raw = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return frame(PacketType.TC, Apid.PAYLOAD, seq, message_type, raw, source_id=NodeId.GROUND, time_us=0), seq


def _uplink(**changes):
    body = {"task_id": "t9", "prompt": "describe", "images": ["a.png"], "max_new_tokens": 4, "priority": 0}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def _chunk(data=b"\x00" * 10, **changes):
    body = {
        "image": "x.png",
        "index": 0,
        "total": 1,
        "offset": 0,
        "image_size": len(data),
        "data": data,
        "crc32c": m.crc32c(data),
        "sha256": hashlib.sha256(data).digest(),
    }
    body.update(changes)
    return body


def _thin_png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (300, 1), (200, 30, 30)).save(buf, "PNG")  # accepted once, failed later on its aspect ratio
    return buf.getvalue()


def _far_ahead(bus):
    seq = (bus.counter.peek(Apid.PAYLOAD) + 100_000) % (1 << 30)
    return encode(m.Ping(key=1), Apid.PAYLOAD, seq, source_id=NodeId.GROUND), seq


def _bad_utf8_prompt():
    raw = msgpack.packb(_uplink(prompt="PLACEHOLDER"), use_bin_type=True)
    return raw.replace(b"PLACEHOLDER", b"\xff\xfeBAD\xc3(\xa0\xa1xx")


CASES = [
    ("malformed", lambda bus: (b"\x18\x20\x00", None), ResponseCode.MALFORMED_PACKET),
    ("bad_crc", lambda bus: _flip_crc(bus), ResponseCode.BAD_CRC),
    ("unknown_command", lambda bus: _tc(bus, 0x01EE, {}), ResponseCode.UNKNOWN_COMMAND),
    ("missing_field", lambda bus: _tc(bus, MessageType.UPLINK_TASK, _uplink(prompt=None)), ResponseCode.MISSING_FIELD),
    ("invalid_utf8", lambda bus: _tc(bus, MessageType.UPLINK_TASK, _bad_utf8_prompt()), ResponseCode.INVALID_UTF8),
    (
        "path_like_name",
        lambda bus: _tc(bus, MessageType.UPLINK_TASK, _uplink(task_id="../etc")),
        ResponseCode.PATH_LIKE_NAME,
    ),
    (
        "oversized_image",
        lambda bus: _tc(bus, MessageType.IMAGE_CHUNK, _chunk(image_size=64 << 20)),
        ResponseCode.IMAGE_TOO_LARGE,
    ),
    ("chunk_crc", lambda bus: _tc(bus, MessageType.IMAGE_CHUNK, _chunk(crc32c=123)), ResponseCode.CHUNK_CRC_MISMATCH),
    (
        "undecodable_image",
        lambda bus: _tc(bus, MessageType.IMAGE_CHUNK, _chunk(data=b"not a picture at all")),
        ResponseCode.IMAGE_UNDECODABLE,
    ),
    # checked at uplink, each with its own code, instead of failing later as something else
    (
        "blank_prompt",
        lambda bus: _tc(bus, MessageType.UPLINK_TASK, _uplink(prompt=" \n\t ")),
        ResponseCode.EMPTY_PROMPT,
    ),
    (
        "thin_image",
        lambda bus: _tc(bus, MessageType.IMAGE_CHUNK, _chunk(data=_thin_png(), image="thin.png")),
        ResponseCode.IMAGE_SHAPE_UNSUPPORTED,
    ),
    ("far_ahead_sequence", _far_ahead, ResponseCode.SEQUENCE_TOO_FAR_AHEAD),
    (
        "release_unknown",
        lambda bus: _tc(bus, MessageType.RELEASE_QUARANTINE, {"item": "task:nope"}),
        ResponseCode.NOT_QUARANTINED,
    ),
]


def _flip_crc(bus):
    seq = bus.counter.next(Apid.PAYLOAD)
    packet = bytearray(encode(m.Ping(key=1), Apid.PAYLOAD, seq, source_id=NodeId.GROUND))
    packet[-1] ^= 0xFF
    return bytes(packet), seq


def test_each_bad_input_has_its_own_code_and_nothing_is_lost(payload):
    bus, proc = payload
    seq = bus.command(
        m.UplinkTask(task_id="waiting", prompt="count the ships", images=["never.png"], max_new_tokens=4, priority=1)
    )
    bus.wait_for(lambda h, x: isinstance(x, m.Accepted) and x.tc_seq == seq)
    codes = {}
    for name, make, expected in CASES:
        packet, seq = make(bus)
        mark = len(bus.received)
        bus.raw(packet)
        rejected = bus.wait_for(
            lambda h, x, seq=seq: isinstance(x, m.Rejected) and (seq is None or x.tc_seq == seq),
            timeout=HANG_S,
            start=mark,
        )[1]
        codes[name] = rejected.code
        assert rejected.code == expected, (name, rejected.code.name, rejected.reason)
        assert rejected.reason
    assert len(set(codes.values())) == len(CASES)  # each class its own code
    # Issue 27, finding 9: a prompt of NULs, zero-width or bidirectional controls only has no
    # visible character either; it was queued (and shown raw on the ground) as a real prompt.
    for prompt in ("\x00\x00", "\u200b\u200c\u200d\u2060\ufeff", "\u202e\u2066\u200f"):
        packet, seq = _tc(bus, MessageType.UPLINK_TASK, _uplink(prompt=prompt))
        mark = len(bus.received)
        bus.raw(packet)
        rejected = bus.wait_for(lambda h, x, seq=seq: isinstance(x, m.Rejected) and x.tc_seq == seq, start=mark)[1]
        assert rejected.code == ResponseCode.EMPTY_PROMPT, (repr(prompt), rejected.code.name, rejected.reason)
    assert proc.poll() is None  # still running
    seq = bus.command(m.Status())
    hk = bus.wait_for(lambda h, x: isinstance(x, m.Housekeeping), start=len(bus.received) - 1)[1]
    assert hk.queue_depth == 1  # the queued task is still there
    assert hk.error_count >= len(CASES) + 3
    seq = bus.command(m.Ping(key=42))
    assert bus.wait_for(lambda h, x: isinstance(x, m.Pong) and x.key == 42)


def test_flight_run_bad_values_are_one_line_errors(tmp_path, model_dirs):
    """Issue 27, finding 8: `--data-dir FILE` was a NotADirectoryError traceback at the first
    write, `--pace-ms -1` was taken silently. Each is one line on stderr (the bus quotes a
    payload's last line) with exit 2, before anything is written; a payload that keeps exiting
    is the bus's boot-loop guard's to hold off."""
    from common.wire.link import init_keys

    keys = init_keys(tmp_path / "keys").root
    a_file = tmp_path / "data-file"
    a_file.write_text("not a directory\n")
    cases = [
        (["--data-dir", str(a_file)], "is a regular file, not a directory"),
        (["--data-dir", str(a_file / "data")], "cannot be created"),
        (["--data-dir", str(tmp_path / "data"), "--pace-ms", "-1"], "--pace-ms must be a finite number >= 0"),
        (["--data-dir", str(tmp_path / "data"), "--results-budget-mb", "nan"], "--results-budget-mb"),
    ]
    for args, fragment in cases:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "common.cli",
                "flight",
                "run",
                "--model",
                model_dirs["qwen3-vl"],
                "--keys",
                str(keys),
                "--payload-endpoint",
                "tcp://127.0.0.1:9",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 2, (args, done.returncode, done.stderr)
        # One line for a person, and before it the boot-failure record the bus reads (the same
        # reason, as JSON: docs/bus.md "boot-loop guard").
        record, *lines = done.stderr.splitlines()
        assert json.loads(record) == {"boot_failed": lines[0].removeprefix("ow flight: error: "), "exit_status": 2}
        assert len(lines) == 1 and lines[0].startswith("ow flight: error: ") and fragment in lines[0], done.stderr
    assert a_file.read_text() == "not a directory\n" and not (tmp_path / "data").exists()
