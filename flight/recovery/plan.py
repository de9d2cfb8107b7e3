"""Recovery plans for the prefill phase: what to read, in which order, and what to compute.

After a reboot nothing is in RAM. Prefill is a grid of blocks (layer group g, token chunk c).
Some blocks have durable records (KV of the group's layers for the chunk, and usually the group's
output hidden state for the chunk); the rest must be computed. A compute (g, c) is ready when the
weights of group g are resident, group g's KV for every chunk < c is present (read or computed),
and its input hidden state exists (computed at (g-1, c), read from (g-1, c)'s record, or the
token embeddings when g = 0).

A plan is two ordered lists that run concurrently: `reads` on one reader thread (weights, KV,
boundary hidden states) and `computes` on the compute thread. The executor starts each compute
as soon as its inputs are present. Planners differ only in the order they choose; `validate`
checks any plan against the dependency rules, so a new planner cannot silently produce a wrong
result. The fresh (uninterrupted) run is the special case with no durable blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple


class PlanError(ValueError):
    pass


class ReadOp(NamedTuple):
    """One read of a plan. A named tuple, not a dataclass: planners build and hash tens of
    thousands of these, and a tuple's construction and hash are several times cheaper."""

    what: str  # "weights" | "kv" | "hidden"
    group: int
    chunk: int = -1

    def __str__(self):
        return f"read {self.what} g{self.group}" + (f" c{self.chunk}" if self.chunk >= 0 else "")


class ComputeOp(NamedTuple):
    group: int
    chunk: int
    kind: str = "block"  # "block": run the group's layers on the chunk; "reproject": rebuild the
    # block's KV from its input hidden state (HCache-style records)

    def __str__(self):
        return f"{'compute' if self.kind == 'block' else 'reproject'} g{self.group} c{self.chunk}"


@dataclass
class RecoveryProblem:
    """The prefill state after a reboot, in planner terms."""

    num_groups: int
    num_chunks: int
    done: set[tuple[int, int]]  # blocks with a durable KV record
    with_hidden: set[tuple[int, int]]  # ... of which also hold the boundary hidden state
    need_last_hidden: bool = True  # first-token logits still to compute
    kv_missing: set[tuple[int, int]] = field(default_factory=set)  # done blocks whose record holds no KV:
    # their KV is re-projected from the input hidden state
    # Optional costs (seconds) for planners that optimise; see flight/recovery/cost.py.
    costs: dict = field(default_factory=dict)

    @property
    def last(self) -> tuple[int, int]:
        return (self.num_groups - 1, self.num_chunks - 1)

    def _key(self) -> tuple:
        return (
            self.num_groups,
            self.num_chunks,
            frozenset(self.done),
            frozenset(self.with_hidden),
            self.need_last_hidden,
            frozenset(self.kv_missing),
        )

    def must_compute(self) -> set[tuple[int, int]]:
        """Blocks to compute: those without a record, plus any done block whose boundary hidden
        state is needed by a computed successor (or by the first-token logits) but not stored.
        (Remembered for the problem's current content: planners ask for it many times.)"""
        key = self._key()
        memo = self.__dict__.get("_must_compute_memo")
        if memo is None or memo[0] != key:
            memo = (key, frozenset(self._must_compute()))
            self.__dict__["_must_compute_memo"] = memo
        return set(memo[1])

    def _must_compute(self) -> set[tuple[int, int]]:
        todo = {(g, c) for g in range(self.num_groups) for c in range(self.num_chunks)} - self.done
        if self.need_last_hidden and self.last not in self.with_hidden:
            todo.add(self.last)
        changed = True
        while changed:
            changed = False
            for g, c in list(todo) + list(self.kv_missing - todo):
                # its input hidden state must exist: stored in (g-1, c)'s record, or computed
                if g > 0 and (g - 1, c) not in todo and (g - 1, c) not in self.with_hidden:
                    todo.add((g - 1, c))
                    changed = True
        return todo

    def reprojections(self) -> set[tuple[int, int]]:
        return self.kv_missing - self.must_compute()

    def needed_reads(self) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """(blocks whose KV must be read, blocks whose hidden state must be read)."""
        todo = self.must_compute()
        kv = self.done - todo - self.kv_missing
        jobs = todo | self.kv_missing  # the computes and the re-projections (kv_missing - todo)
        hidden = {(g - 1, c) for (g, c) in jobs if g > 0 and (g - 1, c) not in todo}
        if self.need_last_hidden and self.last not in todo:
            hidden.add(self.last)
        return kv, hidden


@dataclass
class RecoveryPlan:
    planner: str
    reads: list[ReadOp]
    computes: list[ComputeOp]

    def order_digest(self) -> str:
        """Identifies the order of reads and computes (two plans with equal digests run alike)."""
        return hashlib.sha256(repr((self.reads, self.computes)).encode()).hexdigest()[:16]

    def summary(self) -> dict:
        return {
            "planner": self.planner,
            "order": self.order_digest(),
            "reads": len(self.reads),
            "computes": sum(op.kind == "block" for op in self.computes),
            "reprojections": sum(op.kind == "reproject" for op in self.computes),
            "kv_reads": sum(r.what == "kv" for r in self.reads),
            "hidden_reads": sum(r.what == "hidden" for r in self.reads),
        }

    def validate(self, problem: RecoveryProblem) -> None:
        """Raise PlanError unless executing this plan yields every block's KV and the needed hidden."""
        todo = problem.must_compute()
        kv_needed, hidden_needed = problem.needed_reads()
        reads = set(self.reads)
        for g in range(problem.num_groups):
            if ReadOp("weights", g) not in reads:
                raise PlanError(f"weights of group {g} are never read")
        for g, c in kv_needed:
            if ReadOp("kv", g, c) not in reads:
                raise PlanError(f"KV of block g{g} c{c} is never read")
        for g, c in hidden_needed:
            if ReadOp("hidden", g, c) not in reads:
                raise PlanError(f"hidden state of block g{g} c{c} is never read")
        reproject = problem.reprojections()
        blocks = [(op.group, op.chunk) for op in self.computes if op.kind == "block"]
        rebuilt = [(op.group, op.chunk) for op in self.computes if op.kind == "reproject"]
        if set(blocks) != todo or len(blocks) != len(todo):
            raise PlanError("computes do not cover exactly the blocks that need computing")
        if set(rebuilt) != reproject or len(rebuilt) != len(reproject):
            raise PlanError("re-projections do not cover exactly the blocks stored without KV")
        computed: set[tuple[int, int]] = set()
        for op in self.computes:
            g, c = op.group, op.chunk
            if op.kind == "block":
                for cc in range(c):
                    if ((g, cc) in todo or (g, cc) in reproject) and (g, cc) not in computed:
                        raise PlanError(f"{op} runs before the KV of g{g} c{cc} is rebuilt")
            if g > 0 and (g - 1, c) in todo and (g - 1, c) not in computed:
                raise PlanError(f"{op} runs before its input g{g - 1} c{c} is computed")
            computed.add((g, c))


def _weights_once(reads: list[ReadOp], seen: set[int], g: int) -> None:
    if g not in seen:
        seen.add(g)
        reads.append(ReadOp("weights", g))


def chunk_first(problem: RecoveryProblem) -> RecoveryPlan:
    """Walk the grid chunk by chunk (the order an uninterrupted run computes in)."""
    todo, reproject = problem.must_compute(), problem.reprojections()
    kv, hidden = problem.needed_reads()
    reads: list[ReadOp] = []
    computes: list[ComputeOp] = []
    seen: set[int] = set()
    for c in range(problem.num_chunks):
        for g in range(problem.num_groups):
            _weights_once(reads, seen, g)
            if (g, c) in kv:
                reads.append(ReadOp("kv", g, c))
            if (g, c) in hidden:
                reads.append(ReadOp("hidden", g, c))
            if (g, c) in todo:
                computes.append(ComputeOp(g, c))
            elif (g, c) in reproject:
                computes.append(ComputeOp(g, c, "reproject"))
    for g in range(problem.num_groups):
        _weights_once(reads, seen, g)
    return RecoveryPlan("chunk-first", reads, computes)


def layer_first(problem: RecoveryProblem) -> RecoveryPlan:
    """Walk the grid layer group by layer group: each group's weights, then its KV."""
    todo, reproject = problem.must_compute(), problem.reprojections()
    kv, hidden = problem.needed_reads()
    reads, computes = [], []
    for g in range(problem.num_groups):
        reads.append(ReadOp("weights", g))
        for c in range(problem.num_chunks):
            if (g, c) in kv:
                reads.append(ReadOp("kv", g, c))
            if (g, c) in hidden:
                reads.append(ReadOp("hidden", g, c))
            if (g, c) in todo:
                computes.append(ComputeOp(g, c))
            elif (g, c) in reproject:
                computes.append(ComputeOp(g, c, "reproject"))
    return RecoveryPlan("layer-first", reads, computes)


PLANNERS = {"chunk-first": chunk_first, "layer-first": layer_first}


def make_plan(name: str, problem: RecoveryProblem) -> RecoveryPlan:
    try:
        planner = PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; choose from {', '.join(sorted(PLANNERS))}") from None
    plan = planner(problem)
    plan.validate(problem)
    return plan
