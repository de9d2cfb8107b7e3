"""Run a prefill plan: one reader thread for the plan's reads, the compute loop on the caller's
thread, each compute started as soon as its inputs are present.

Reads and computes really overlap: file reads and torch kernels release the GIL. A read that
fails verification stops the plan with `RecordRejected`; the engine quarantines that record,
rescans and re-plans (the only state lost is what this attempt computed). A run asked to stop
ends the plan after the compute where it was asked (`halted`, looked at after each compute):
the reader stops after its current read and `run` returns with `stats.halted` set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.record import RecordError

from .plan import ComputeOp, ReadOp, RecoveryPlan


class RecordRejected(Exception):
    def __init__(self, op: ReadOp, error: RecordError):
        super().__init__(f"{op}: {error}")
        self.op = op
        self.error = error


@dataclass
class ExecutionStats:
    read_seconds: float = 0.0
    compute_seconds: float = 0.0
    stall_seconds: float = 0.0  # compute thread waiting for reads
    bytes_read: int = 0
    wall_seconds: float = 0.0
    timeline: list = field(default_factory=list)  # (op, start, end) for plots
    halted: bool = False  # the plan ended early: its run was asked to stop


class PlanExecutor:
    """`do_read(op) -> bytes read` and `do_compute(op)` perform the work; this class orders it.
    `halted()`, when given, says after each compute whether the plan ends there."""

    def __init__(
        self,
        plan: RecoveryPlan,
        do_read,
        do_compute,
        overlap: bool = True,
        halted: Callable[[], bool] | None = None,
    ):
        self.plan = plan
        self.do_read = do_read
        self.do_compute = do_compute
        self.overlap = overlap
        self.halted = halted
        self.stats = ExecutionStats()
        self._done_reads: set[ReadOp] = set()
        self._computed: set[tuple[int, int]] = set()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._reads_finished = False

    def _reader(self, t0: float) -> None:
        try:
            for op in self.plan.reads:
                start = time.perf_counter()
                n = self.do_read(op)
                end = time.perf_counter()
                self.stats.read_seconds += end - start
                self.stats.bytes_read += n or 0
                self.stats.timeline.append((str(op), start - t0, end - t0))
                with self._cond:
                    self._done_reads.add(op)
                    self._cond.notify_all()
                if self._error is not None or self.stats.halted:
                    return
        except RecordError as exc:
            self._fail(RecordRejected(op, exc))
        except BaseException as exc:  # surfaced on the compute thread
            self._fail(exc)
        finally:
            with self._cond:
                self._reads_finished = True
                self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _ready(self, op: ComputeOp, needs: list[ReadOp], needs_computed: list[tuple[int, int]]) -> bool:
        return all(r in self._done_reads for r in needs) and all(b in self._computed for b in needs_computed)

    def dependencies(self, op: ComputeOp) -> tuple[list[ReadOp], list[tuple[int, int]]]:
        """What must be present before `op` runs: reads done, and computes (blocks or
        re-projections, by (group, chunk)) done."""
        scheduled = {(c.group, c.chunk): c.kind for c in self.plan.computes}
        reads, computed = [ReadOp("weights", op.group)], []  # weights come from the plan's reader alone
        if op.kind == "block":
            for c in range(op.chunk):  # this group's KV for every earlier chunk
                if (op.group, c) in scheduled:
                    computed.append((op.group, c))
                else:
                    reads.append(ReadOp("kv", op.group, c))
        if op.group > 0:  # the input hidden state
            prev = (op.group - 1, op.chunk)
            if scheduled.get(prev) == "block":
                computed.append(prev)
            else:
                reads.append(ReadOp("hidden", op.group - 1, op.chunk))
        return reads, computed

    def run(self) -> ExecutionStats:
        t0 = time.perf_counter()
        reader = threading.Thread(target=self._reader, args=(t0,), name="recovery-reader", daemon=True)
        reader.start()
        if not self.overlap:
            reader.join()
        try:
            for op in self.plan.computes:
                needs, needs_computed = self.dependencies(op)
                wait_start = time.perf_counter()
                with self._cond:
                    while self._error is None and not self._ready(op, needs, needs_computed):
                        if self._reads_finished:
                            missing = [str(r) for r in needs if r not in self._done_reads]
                            raise RuntimeError(f"plan never provides {missing} for {op}")
                        self._cond.wait()
                    if self._error is not None:
                        raise self._error
                start = time.perf_counter()
                self.stats.stall_seconds += start - wait_start
                self.do_compute(op)
                end = time.perf_counter()
                self.stats.compute_seconds += end - start
                self.stats.timeline.append((str(op), start - t0, end - t0))
                self._computed.add((op.group, op.chunk))
                if self.halted is not None and self.halted():
                    with self._cond:
                        self.stats.halted = True  # the reader ends after its current read
                    break
        except BaseException as exc:
            self._fail(exc)
            reader.join()
            raise
        reader.join()
        if self._error is not None and not self.stats.halted:  # a stopped run replans nothing
            raise self._error
        self.stats.wall_seconds = time.perf_counter() - t0
        return self.stats
