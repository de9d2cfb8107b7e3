"""Recovery plans for the vision and decode phases, beside prefill's (plan.py, executor.py).

After a reboot every phase has reads to do before its first unit of work, and every phase has
work whose inputs arrive one after another. Reading everything first and computing after
exposes the whole read time; reading in the order the work needs it, on one reader thread
while the compute thread runs whatever is ready, hides what it can:

vision   reads: the newest vision state, the vision weights from the block it resumes at on
         (blocks before it are never needed), the merger, then the language model's weights
         in layer order (prefill follows). Computes: the remaining vision blocks, each once its
         weights are in.
prefill  the prefill plan (plan.py). When some first-group block with visual tokens must be
         recomputed, the merged visual tokens (vision.out) are the reader's first read instead
         of a read on the compute thread in the middle of that block.
decode   reads: per layer group, its weights and its prefill KV (the decode records' KV is part
         of the frontier scan). Computes: the first decode step, one layer group at a time, each
         as soon as that group's reads are done -- the step finishes right after the last read
         instead of one whole step after it.

`ReadAhead` runs an ordered list of reads on one thread (vision); `PhaseExecutor` extends the
prefill executor with the vision.out read and the first decode step's layer groups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .executor import PlanExecutor
from .plan import ReadOp

#: the read of the merged visual tokens (vision.out), first in a prefill plan that needs them
VISION_OUT = ReadOp("vision_out", 0)


def vision_groups(layer_groups: list[tuple[int, int]], deepstack_layers: int) -> frozenset:
    """The layer groups whose blocks need the vision output: group 0 (its input embeds the visual
    tokens) and every group holding a DeepStack layer (one of the first `deepstack_layers`
    decoder layers, which add visual features)."""
    return frozenset(group for group, (first, _) in enumerate(layer_groups) if group == 0 or first < deepstack_layers)


def needs_vision_out(op, vision_groups: frozenset, visual_chunks: frozenset) -> bool:
    """Whether a prefill compute needs the vision output: a block of a group in `vision_groups`
    on a chunk holding visual tokens, or a re-projection of group 0 on such a chunk (its input is
    the chunk's embeddings, the visual tokens among them; a later group re-projects from the
    stored hidden state, which already holds them)."""
    if op.chunk not in visual_chunks:
        return False
    return (op.kind == "block" and op.group in vision_groups) or (op.kind == "reproject" and op.group == 0)


@dataclass(frozen=True)
class StepOp:
    """The first decode step after a restart, through the layers of one group."""

    group: int
    chunk: int = -1
    kind: str = "decode"

    def __str__(self):
        return f"decode step g{self.group}"


class ReadAhead:
    """Reads in order on one thread: `(name, fn)` pairs; `fn()` returns (value, bytes read). The
    compute thread takes a named value with `result(name)` (waiting for it) and relies on the
    weight store's own waiting for weights. `stop()` abandons the reads not yet started."""

    def __init__(self, reads: Sequence[tuple[str, Callable[[], tuple[object, int]]]]):
        self.reads = reads
        self.results: dict[str, object] = {}
        self.errors: dict[str, BaseException] = {}
        self.read_seconds = 0.0
        self.bytes_read = 0
        self.order = [name for name, _ in reads]
        self._done: set[str] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="recovery-read-ahead", daemon=True)

    def start(self) -> ReadAhead:
        self._thread.start()
        return self

    def _run(self) -> None:
        for name, fn in self.reads:
            if self._stop:
                break
            start = time.perf_counter()
            try:
                value, nbytes = fn()
            except BaseException as exc:  # handed to whoever waits for it
                value, nbytes = None, 0
                self.errors[name] = exc
            self.read_seconds += time.perf_counter() - start
            self.bytes_read += nbytes or 0
            with self._cond:
                self.results[name] = value
                self._done.add(name)
                self._cond.notify_all()
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def result(self, name: str):
        """The value of read `name`, once it is done (None if the reader stopped before it)."""
        with self._cond:
            while name not in self._done and not self._stop:
                self._cond.wait()
        if name in self.errors:
            raise self.errors[name]
        return self.results.get(name)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def summary(self) -> dict:
        return {"reads": len(self.order), "read_s": round(self.read_seconds, 6), "bytes_read": self.bytes_read}


class PhaseExecutor(PlanExecutor):
    """The prefill plan's executor, plus the vision.out read (VISION_OUT, needed by the blocks of
    `vision_groups` -- group 0, whose input embeds the visual tokens, and any group holding a
    DeepStack layer, which adds visual features -- whose chunk holds visual tokens,
    `visual_chunks`) and the first decode step's layer
    groups (StepOp: group g waits for its weights, its KV -- read or computed for every chunk --
    and the step through group g - 1)."""

    def __init__(
        self,
        plan,
        do_read,
        do_compute,
        overlap: bool = True,
        visual_chunks: frozenset = frozenset(),
        num_chunks: int = 0,
        vision_groups: frozenset = frozenset({0}),
        halted=None,
    ):
        super().__init__(plan, do_read, do_compute, overlap, halted)
        self.visual_chunks = visual_chunks
        self.vision_groups = vision_groups
        self.num_chunks = num_chunks
        # prefill work that rebuilds a block's KV (a block compute or a re-projection)
        self._scheduled = {(c.group, c.chunk) for c in plan.computes if c.kind in ("block", "reproject")}

    def dependencies(self, op):
        if isinstance(op, StepOp):
            reads, computed = [ReadOp("weights", op.group)], []
            for c in range(self.num_chunks):
                if (op.group, c) in self._scheduled:
                    computed.append((op.group, c))
                else:
                    reads.append(ReadOp("kv", op.group, c))
            if op.group > 0:
                computed.append((op.group - 1, -1))
            return reads, computed
        reads, computed = super().dependencies(op)
        if VISION_OUT in self.plan.reads and needs_vision_out(op, self.vision_groups, self.visual_chunks):
            reads.append(VISION_OUT)
        return reads, computed
