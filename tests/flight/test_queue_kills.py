"""SIGKILL the queue writer at 25 random instants: after every restart the queue equals the
effect of a prefix of the operations that covers every acknowledged one (nothing acknowledged
is lost; at most the one operation in flight is either in or out); earlier runs stay intact."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import queue_hammer

from flight.runtime.queue import TaskQueue


def _expected(run: int, count: int, base: dict, next_order: int) -> dict:
    """Live tasks after the first `count` operations of `run`, on top of `base` (finished tasks
    leave the journal for the result store, so the arrival counter is carried separately)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        q = TaskQueue(d)
        q._tasks = dict(base)
        q._next_order = next_order
        for i, op in enumerate(queue_hammer.operations(run)):
            if i == count:
                break
            queue_hammer.apply(q, op)
        return {k: vars(v).copy() for k, v in q.snapshot().items()}


def test_queue_survives_sigkill_at_random_instants(tmp_path):
    directory = str(tmp_path / "queue")
    rng = np.random.default_rng(5)
    base: dict = {}
    next_order = 0
    script = os.path.join(os.path.dirname(__file__), "queue_hammer.py")
    for run in range(25):
        proc = subprocess.Popen(
            [sys.executable, script, directory, str(run)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert proc.stdout.readline().strip() == "open"
        time.sleep(rng.uniform(0.01, 0.25))
        proc.send_signal(signal.SIGKILL)
        acked = [int(line) for line in proc.stdout.read().split()]
        proc.wait()
        last_acked = acked[-1] if acked else -1
        q = TaskQueue(directory)
        state = {k: vars(v).copy() for k, v in q.snapshot().items()}
        acked_only = _expected(run, last_acked + 1, _objects(base), next_order)
        with_inflight = _expected(run, last_acked + 2, _objects(base), next_order)
        assert state in (acked_only, with_inflight), f"run {run}: queue does not match {last_acked + 1} ops"
        damage = q.journal_damage()
        assert damage.bytes_dropped == 0 and not damage.named  # a cut tears at most the tail
        base, next_order = state, q._next_order
    assert len(base) > 50


def _objects(state: dict):
    from flight.runtime.queue import Task, request_ref

    out = {}
    for k, v in state.items():
        v = dict(v)
        v["request"] = request_ref(v["request"])
        out[k] = Task(**v)
    return out
