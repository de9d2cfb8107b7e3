"""A stop (SIGTERM, as an operator or a service manager sends it) is clean: the payload exits 0 at
the end of a unit of work, leaves no crash record and counts no abnormal exit; the next boot
resumes the task to the same tokens and logits as an uninterrupted run.

Before: the process returned with its worker inside torch, the interpreter's shutdown aborted
(SIGABRT, exit -6), faulthandler wrote "Fatal Python error: Aborted" to the crash record, and the
next boot counted an abnormal exit against the task (three such stops without progress quarantine it).
"""

from __future__ import annotations

import signal

import pytest
from test_red_team import Payload, _final, _png, _reference_logits, _upload, _verdict
from testkit import HANG_S

from common.record import Kind, decode
from common.wire import ResponseCode
from common.wire import messages as m

pytestmark = pytest.mark.slow
# Long enough that the stop lands mid-decode on any machine: here a step takes ~3 ms and ~40 steps
# pass between the progress report the test waits for and the stop taking effect (wall time spent
# in the link and the signal, so a faster machine gets more steps in; 1000 leaves 25 times that).
TOKENS = 1000


def test_sigterm_mid_decode_is_a_clean_stop_and_the_task_resumes_bitwise(tmp_path, model_dirs):
    model = model_dirs["qwen3-vl"]
    data = tmp_path / "data"
    scene = _png(11, (96, 64))
    first = Payload(tmp_path, model, data)
    try:
        _upload(first.bus, "scene.png", scene)
        seq = first.bus.command(
            m.UplinkTask(task_id="t1", prompt="describe", images=["scene.png"], max_new_tokens=TOKENS, priority=9)
        )
        assert isinstance(_verdict(first.bus, seq), m.Accepted)
        first.bus.wait_for(
            lambda h, x: isinstance(x, m.Progress) and x.task_id == "t1" and x.phase.name == "DECODE" and x.done >= 3,
            300,
        )
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(HANG_S) == 0, (tmp_path / "flight.log").read_text()[-3000:]
    finally:
        first.close()
    crash = data / "health" / "crash.log"
    assert not crash.exists() or not crash.read_text().strip(), crash.read_text()
    assert "task_paused_for_stop" in (tmp_path / "flight.log").read_text()  # it stopped mid-task

    second = Payload(tmp_path, model, data)
    try:
        done = _final(second.bus, "t1", 300)
        assert isinstance(done, m.Completed), done
        result = second.bus.wait_for(lambda h, x: isinstance(x, m.TaskResult) and x.task_id == "t1", HANG_S)[1]
        resumed = [x for _, x in second.bus.received if isinstance(x, m.Event) and x.event_id.name == "TASK_RESUMED"]
        assert resumed  # not started again from nothing
    finally:
        second.close()
    state = data / "health" / "state.rec"  # written only once something is counted
    if state.exists():
        health, _ = decode(state.read_bytes(), expect_kind=Kind.HEALTH_STATE)
        assert health.meta["abnormal_exits"] == 0 and not health.meta["exits"], health.meta
    assert result.logits_sha256.hex() == _reference_logits(model, [scene], "describe", TOKENS)


def test_a_cancel_of_the_running_task_ends_it_at_a_unit_boundary(tmp_path, model_dirs):
    """CANCEL_TASK for the task the worker is on cancels its StopToken: the engine returns at its
    next unit boundary (no exception through it), the task ends CANCELLED, its records go, and
    the worker takes the next task."""
    model = model_dirs["qwen3-vl"]
    data = tmp_path / "data"
    payload = Payload(tmp_path, model, data)
    try:
        _upload(payload.bus, "scene.png", _png(11, (96, 64)))
        seq = payload.bus.command(
            m.UplinkTask(task_id="t1", prompt="describe", images=["scene.png"], max_new_tokens=TOKENS, priority=9)
        )
        assert isinstance(_verdict(payload.bus, seq), m.Accepted)
        payload.bus.wait_for(
            lambda h, x: isinstance(x, m.Progress) and x.task_id == "t1" and x.phase.name == "DECODE" and x.done >= 3,
            300,
        )
        assert (data / "tasks" / "t1").is_dir(), "the running task has a directory"
        cancel = payload.bus.command(m.CancelTask(task_id="t1"))
        assert isinstance(_verdict(payload.bus, cancel), m.Accepted)
        final = _final(payload.bus, "t1", 120)
        assert isinstance(final, m.Failed) and final.code == ResponseCode.CANCELLED, final
        payload.bus.wait_for(lambda h, x: isinstance(x, m.Event) and x.event_id.name == "TASK_CANCELLED", HANG_S)
        progress = [x.done for _, x in payload.bus.received if isinstance(x, m.Progress) and x.task_id == "t1"]
        assert max(progress) < TOKENS - 1, "the task ran to its end instead of stopping"
        # the worker is free: a second task runs to its end
        seq = payload.bus.command(
            m.UplinkTask(task_id="t2", prompt="describe", images=["scene.png"], max_new_tokens=3, priority=9)
        )
        assert isinstance(_verdict(payload.bus, seq), m.Accepted)
        assert isinstance(_final(payload.bus, "t2", 300), m.Completed)
        assert payload.alive()
    finally:
        payload.close()
    assert not (data / "tasks" / "t1").exists(), "a cancelled task's records stayed"
