"""The policy endpoint: openpi wire format, clear errors, other robots unaffected, loopback only."""

import threading

import msgpack
import numpy as np
import pytest
from websockets.sync.client import connect

from common.vla import wire
from common.vla.engine import ServingEngine
from common.vla.server import PolicyServer, ServerConfig, require_loopback


def libero_obs(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.standard_normal(8),
        "prompt": "put the bowl on the plate",
    }


@pytest.fixture(scope="module")
def server():
    engine = ServingEngine.build(
        ["pi0", "smolvla"],
        slo_ms={"pi0": 2000.0, "smolvla": 2000.0},
        max_batch=2,
        batch_sizes=(1, 2),
        backend="cpu",
        threads=2,
    ).start()
    srv = PolicyServer(engine, ServerConfig(port=0, max_request_bytes=400_000)).start()
    yield srv
    srv.stop()
    engine.stop()


def roundtrip(ws, payload):
    ws.send(payload)
    reply = ws.recv(timeout=60)
    return reply if isinstance(reply, str) else wire.unpackb(reply)


def test_metadata_then_actions(server):
    with connect(server.url, max_size=None) as ws:
        meta = wire.unpackb(ws.recv(timeout=10))
        assert meta["model"] == "pi0" and meta["action_horizon"] == 50 and meta["action_dim"] == 7
        out = roundtrip(ws, wire.packb(libero_obs()))
        assert out["actions"].shape == (50, 7) and out["actions"].dtype == np.float32
        assert out["server_timing"]["infer_ms"] > 0 and out["model"] == "pi0"
        out2 = roundtrip(ws, wire.packb(libero_obs(1)))
        assert "prev_total_ms" in out2["server_timing"]


def test_model_selected_by_path_and_unknown_path_refused(server):
    with connect(server.url + "/smolvla") as ws:
        assert wire.unpackb(ws.recv(timeout=10))["model"] == "smolvla"
        assert roundtrip(ws, wire.packb(libero_obs()))["model"] == "smolvla"
    with connect(server.url + "/nope") as ws:
        msg = ws.recv(timeout=10)
        assert isinstance(msg, str) and "unknown model" in msg


BAD = [
    (b"\xc1\xc1not msgpack", "not valid msgpack"),
    (wire.packb([1, 2, 3]), "must be a map"),
    (wire.packb({"prompt": "x"}), "missing"),
    (wire.packb({**libero_obs(), "observation/image": np.zeros((100, 100, 3), np.uint8)}), "224x224x3"),
    (wire.packb({**libero_obs(), "observation/state": np.zeros(5)}), "8 finite numbers"),
    (wire.packb({**libero_obs(), "observation/state": np.full(8, np.nan)}), "8 finite numbers"),
    (wire.packb({**libero_obs(), "observation/image": np.zeros((224, 224, 3), np.int8)}), "uint8 or float"),
    (wire.packb({**libero_obs(), "prompt": 7}), "string"),
    # an array header whose byte count does not match its shape
    (
        msgpack.packb(
            {"observation/state": {b"__ndarray__": True, b"data": b"\0" * 3, b"dtype": "<f4", b"shape": [8]}}
        ),
        "do not hold",
    ),
    # object arrays are refused (openpi's packer refuses them too; never unpickle a robot's bytes)
    (msgpack.packb({"x": {b"__ndarray__": True, b"data": b"", b"dtype": "|O", b"shape": [0]}}), "not accepted"),
]


@pytest.mark.parametrize("payload,expect", BAD)
def test_malformed_requests_get_a_clear_error_and_the_connection_survives(server, payload, expect):
    with connect(server.url) as ws:
        ws.recv(timeout=10)
        reply = roundtrip(ws, payload)
        assert isinstance(reply, str) and reply.startswith("error:") and expect in reply
        assert roundtrip(ws, wire.packb(libero_obs()))["actions"].shape == (50, 7)


def test_text_frames_and_oversized_requests_are_refused(server):
    with connect(server.url, max_size=None) as ws:
        ws.recv(timeout=10)
        assert "text frame" in roundtrip(ws, "hello")
        big = wire.packb({**libero_obs(), "junk": np.zeros(500_000, np.uint8)})
        reply = roundtrip(ws, big)
        assert isinstance(reply, str) and "exceeds the limit" in reply
        assert roundtrip(ws, wire.packb(libero_obs()))["actions"].shape == (50, 7)


def test_bad_robot_does_not_disturb_other_robots(server):
    results, errors = [], []

    def good_robot(seed):
        try:
            with connect(server.url + "/smolvla") as ws:
                ws.recv(timeout=10)
                for i in range(4):
                    results.append(roundtrip(ws, wire.packb(libero_obs(seed + i)))["actions"].shape)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=good_robot, args=(s,)) for s in (10, 20)]
    for t in threads:
        t.start()
    with connect(server.url) as bad:
        bad.recv(timeout=10)
        for _ in range(6):
            assert isinstance(roundtrip(bad, b"\x00garbage"), str)
    for t in threads:
        t.join(60)
    assert not errors and results == [(50, 7)] * 8


def test_health_endpoint(server):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as r:
        assert r.status == 200


def test_only_loopback_addresses():
    assert require_loopback("127.0.0.1") and require_loopback("localhost")
    for host in ("0.0.0.0", "8.8.8.8"):
        with pytest.raises(ValueError):
            require_loopback(host)


def test_wire_format_is_openpis():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = msgpack.unpackb(wire.packb({"a": arr, "s": np.float32(1.5)}), raw=False, strict_map_key=False)
    enc = raw["a"]
    assert enc[b"__ndarray__"] is True and enc[b"dtype"] == "<f4" and enc[b"shape"] == [2, 3]
    assert enc[b"data"] == arr.tobytes() and raw["s"][b"__npgeneric__"] is True
    back = wire.unpackb(wire.packb({"a": arr}))
    np.testing.assert_array_equal(back["a"], arr)
    with pytest.raises(ValueError):
        wire.packb(np.array([object()]))
