"""What the payload has imported at the instants that matter on a short window (docs/flight.md
"Boot"): when it answers a PING, nothing of the engine is on the thread that answers -- the recovery
planner (`optimal`, the default, with numpy) included; by the end of the first unit of work of a
resumed task the engine has run, and what it imported did so on the inference worker.

A real `ow flight run` on the scripted bus, under tests/flight/import_probe.py, which records the
process's `sys.modules` when the test signals it."""

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
from testkit import make_images

from common.wire import messages as m
from hil.scripted_bus import BusPeer, spawn_flight

# What only the inference worker may import: the engine, its recovery planner and what they bring.
ENGINE_MODULES = ("torch", "transformers", "numpy", "flight.engine", "flight.recovery")


def _snapshot(proc, record, count: int, deadline_s: float = 60.0) -> dict:
    """Signal the probe and wait for its `count`-th line in the record."""
    os.kill(proc.pid, signal.SIGUSR1)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if os.path.exists(record):
            with open(record) as f:
                # whole lines only: the probe's line is long (every module's name) and may be read
                # while the probe is still writing it
                lines = f.read().split("\n")[:-1]
            if len(lines) >= count:
                return json.loads(lines[count - 1])
        time.sleep(0.05)
    raise TimeoutError(f"the import probe wrote no snapshot {count} within {deadline_s} s")


def _is_engine(name: str) -> bool:
    return any(name == top or name.startswith(top + ".") for top in ENGINE_MODULES)


@pytest.fixture
def bus(tmp_path):
    peer = BusPeer(str(tmp_path / "keys"))
    yield peer
    peer.close()


def test_the_thread_that_answers_the_bus_imports_no_engine_and_no_planner(bus, tmp_path, model_dirs):
    record = tmp_path / "imports.jsonl"
    proc = spawn_flight(
        tmp_path / "data",
        model_dirs["qwen3-vl"],
        tmp_path / "keys",
        bus.endpoint,
        log_path=tmp_path / "flight.log",
        launcher=(str(Path(__file__).with_name("import_probe.py")), str(record)),
    )
    try:
        bus.wait_connected()
        answer = bus.answer(m.Ping(key=7))
        assert isinstance(answer, m.Accepted)
        at_ping = _snapshot(proc, record, 1)
        on_main = [n for n, t in at_ping["thread_of"].items() if t == "MainThread" and _is_engine(n)]
        assert on_main == [], f"the thread that answers the bus imported {on_main[:8]}"

        for i, im in enumerate(make_images()):
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            for chunk in m.ImageChunk.split(f"img{i}.png", buf.getvalue(), chunk_bytes=32 << 10):
                assert isinstance(bus.answer(chunk), m.Accepted)
        bus.command(
            m.UplinkTask(
                task_id="t", prompt="count the ships", images=["img0.png", "img1.png"], max_new_tokens=4, priority=1
            )
        )
        bus.wait_for(lambda h, msg: isinstance(msg, m.Progress) and msg.task_id == "t", 300)
        at_first_unit = _snapshot(proc, record, 2)
        # the worker ran the engine with the planner the product flies
        assert "flight.recovery.optimal" in at_first_unit["modules"]
        on_main = [n for n, t in at_first_unit["thread_of"].items() if t == "MainThread" and _is_engine(n)]
        assert on_main == [], f"the thread that answers the bus imported {on_main[:8]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
