"""The worker's progress, read by other threads while the worker writes it: every snapshot is
one the worker made (a task's id with that task's own phase and counts), never a mix."""

from __future__ import annotations

import threading

from common.wire import TaskPhase
from flight.runtime.current import IDLE, CurrentWork


def test_a_reader_never_sees_one_task_with_another_tasks_progress():
    current = CurrentWork()
    done = threading.Event()

    def worker():
        for n in range(1, 3001):
            current.start(f"t{n}", TaskPhase.VISION)
            for unit in range(1, 4):
                current.advance(TaskPhase.PREFILL, unit * n, 3 * n)  # counts that name the task
            current.set_phase(TaskPhase.COMPLETED)
            current.idle()
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    while not done.is_set():
        now = current.snapshot()
        if now.task is None:
            assert now == IDLE
            continue
        n = int(now.task[1:])
        assert now.total in (0, 3 * n) and now.done in (0, n, 2 * n, 3 * n), now
    thread.join(timeout=60)
    assert not thread.is_alive(), "the writer thread did not finish"
    assert current.snapshot() == IDLE


def test_advance_returns_the_progress_it_replaced():
    current = CurrentWork()
    current.start("a", TaskPhase.RECOVERING)
    assert current.advance(TaskPhase.PREFILL, 1, 4).phase == TaskPhase.RECOVERING
    assert current.advance(TaskPhase.PREFILL, 2, 4).phase == TaskPhase.PREFILL
    assert current.snapshot().done == 2
