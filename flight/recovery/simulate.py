"""Score any recovery plan with the executor's semantics, in modelled time.

The executor (flight/recovery/executor.py) runs `plan.reads` in order on one reader thread and
`plan.computes` in order on the compute thread; a compute starts when the compute unit is free
and its inputs are present:
    weights of its group read;
    a block compute: for every earlier chunk of its group, that chunk's compute or re-projection
    done if the plan has one, else its KV read;
    for g > 0: block (g-1, c) computed if the plan computes it, else its hidden state read.
A re-projection (KV rebuilt from the input hidden state) needs only the weights and that input.
Reads never wait (they depend on nothing), so the reader is busy from 0 to the sum of all reads.
The makespan is when both are done: decode needs every layer's KV and weights.

A plan whose compute would wait forever (an input the plan never provides, or a block computed
after one that needs it) raises PlanError: the executor would deadlock or fail on it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import cast

from .cost import BlockCosts
from .plan import ComputeOp, PlanError, ReadOp, RecoveryPlan, RecoveryProblem


@dataclass
class Schedule:
    makespan: float
    read_end: float  # the reader's last read ends
    compute_end: float  # the last compute ends
    compute_busy: float  # total compute time
    stall: float  # compute unit idle before its last compute (waiting for reads)
    reads: list[tuple[ReadOp, float, float]]  # (op, start, end)
    computes: list[tuple[ComputeOp, float, float]]

    @property
    def exposed_io(self) -> float:
        """Time the compute unit is not computing: read time the plan failed to hide."""
        return self.makespan - self.compute_busy

    @property
    def tail(self) -> float:
        """Reads still running after the last compute."""
        return self.makespan - self.compute_end


def read_timeline(reads: list[ReadOp], costs: BlockCosts) -> tuple[dict[ReadOp, float], list, float]:
    """(end time of each read's first occurrence, [(op, start, end)], reader finish time)."""
    ends: dict[ReadOp, float] = {}
    spans, t = [], 0.0
    for op in reads:
        start, t = t, t + costs.read_s(op)
        spans.append((op, start, t))
        ends.setdefault(op, t)  # the executor marks an input present on its first read
    return ends, spans, t


def simulate(
    plan: RecoveryPlan,
    problem: RecoveryProblem,
    costs: BlockCosts | None = None,
    *,
    compute_from: float = 0.0,
    after_compute=None,
) -> Schedule:
    """The schedule of `plan` (reads from time 0). `compute_from`: the compute unit starts no
    earlier (e.g. the reader's finish, for a restore that reads everything before computing).
    `after_compute(op, end) -> free`: when the compute unit is free again after `op` ended at
    `end` (a synchronous checkpoint write, or waiting for room in the writer's queue); the
    lifecycle simulator (hil/sim) uses both."""
    costs = costs if costs is not None else BlockCosts.for_problem(problem)
    read_end, read_spans, reader_done = read_timeline(plan.reads, costs)
    scheduled = {(op.group, op.chunk): op.kind for op in plan.computes}
    # Per group, over chunks: latest KV read end among the chunks the plan does not compute
    # (inf where one was never read), and which chunks the plan does compute.
    kv_ready_below: list[list[float]] = []
    jobs_below: list[list[int]] = []
    for g in range(problem.num_groups):
        ready_by_chunk: list[float] = []
        t = 0.0
        for c in range(problem.num_chunks):
            ready_by_chunk.append(t)  # inputs from chunks < c
            if (g, c) not in scheduled:
                t = max(t, read_end.get(ReadOp("kv", g, c), float("inf")))
        kv_ready_below.append(ready_by_chunk)
        jobs_below.append([])
    for g, c in sorted(scheduled):
        jobs_below[g].append(c)
    computed: dict[tuple[int, int], float] = {}
    free, busy, stall = compute_from, 0.0, 0.0
    spans: list[tuple[ComputeOp, float, float]] = []

    def read_ready(op: ReadOp, needed_by: ComputeOp) -> float:
        try:
            return read_end[op]
        except KeyError:
            raise PlanError(f"{needed_by} waits for '{op}', which the plan never reads") from None

    def computed_ready(block: tuple[int, int], needed_by: ComputeOp) -> float:
        try:
            return computed[block]
        except KeyError:
            raise PlanError(f"{needed_by} waits for g{block[0]} c{block[1]}, computed later or never") from None

    # finish times of each group's jobs, aligned with jobs_below (None: not computed yet)
    job_end: list[list[float | None]] = [[None] * len(chunks) for chunks in jobs_below]
    job_pos = {(g, c): i for g, chunks in enumerate(jobs_below) for i, c in enumerate(chunks)}
    compute_s = costs.compute_s
    for op in plan.computes:
        g, c, kind = op
        if (g, c) in computed:
            raise PlanError(f"{op} appears twice")
        ready = read_ready(ReadOp("weights", g), op)
        if kind == "block":
            kv = kv_ready_below[g][c]
            if kv == float("inf"):
                unread = next(
                    ReadOp("kv", g, cc)
                    for cc in range(c)
                    if (g, cc) not in scheduled and ReadOp("kv", g, cc) not in read_end
                )
                read_ready(unread, op)
            if kv > ready:
                ready = kv
            earlier = job_end[g][: bisect.bisect_left(jobs_below[g], c)]
            if earlier:
                if None in earlier:
                    cc = jobs_below[g][earlier.index(None)]
                    computed_ready((g, cc), op)
                latest = max(cast(list[float], earlier))  # no None left: computed_ready raised
                if latest > ready:
                    ready = latest
        if g > 0:
            dep = (
                computed_ready((g - 1, c), op)
                if scheduled.get((g - 1, c)) == "block"
                else read_ready(ReadOp("hidden", g - 1, c), op)
            )
            if dep > ready:
                ready = dep
        start = free if free > ready else ready
        stall += start - free
        end = start + compute_s(g, c, kind)
        busy += end - start
        computed[(g, c)] = end
        job_end[g][job_pos[(g, c)]] = end
        spans.append((op, start, end))
        free = end if after_compute is None else after_compute(op, end)
    return Schedule(
        makespan=max(free, reader_done),
        read_end=reader_done,
        compute_end=free,
        compute_busy=busy,
        stall=stall,
        reads=read_spans,
        computes=spans,
    )
