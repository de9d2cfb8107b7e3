"""The `optimal` recovery planner: a subset dynamic programme over layer groups.

Model and proof sketch: docs/recovery.md §3-§5. In short:

* Reads never wait, so the reader finishes at the sum of all reads whatever the order; a read
  that no compute needs (weights of a group with nothing to compute, KV of a group's chunks after
  its last recomputed chunk, the final hidden state) goes last without loss.
* The remaining ("gating") reads are issued group by group: a group's *bundle* is its weights,
  then its KV and input hidden states in the order its computes need them. The decision is the
  order of the groups that have something to compute.
* Given the reads, ordering computes by release time (when their inputs, and their inputs'
  inputs, are read), ties in (group, chunk) order, is optimal for one compute unit.
* A block's dependencies span a contiguous range of groups [lo, g]. So after the bundles of a
  set S, exactly the blocks whose range lies inside S are computable; reading group g next
  releases those whose range contains g and lies inside the run of S + {g} around g, at offsets
  inside g's bundle. The compute finish time obeys
      f(S + g) = max(f(S) + P(a, g, b), R(S) + h(a, g, b))
  where R(S) is the read time of S's bundles (order-independent), [a, b] the run around g,
  P the compute time released and h the release-to-finish span of that batch -- both depend on
  (a, g, b) only, so they are O(G^3) tables, and f needs no other state. The DP over the 2^G sets
  is exact; the makespan is max(f(all), total read time). It runs as a branch and bound from the
  best fixed plan (flight/recovery/subset_dp.py).

Above MAX_EXACT_GROUPS groups with something to compute (G = 1 on a 36-layer model), runs of k
consecutive groups are merged into parts whose bundles are read back to back, and the same DP
orders the parts -- exact over those orders, not over all group orders (`Solution.exact`).

Speed: the planner runs at every boot after a power cut, so it works on numpy grids of the
problem (one row per group, one column per chunk) rather than per operation, and reads are
numbered (`Structure.read_id`) so a read order is an integer array; plan objects (ReadOp,
ComputeOp) are built only for the plan returned.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np

from .cost import BlockCosts
from .plan import PLANNERS, ComputeOp, PlanError, ReadOp, RecoveryPlan, RecoveryProblem, chunk_first, layer_first
from .subset_dp import full_dp, pruned_dp

MAX_EXACT_GROUPS = 20  # 2^20 sets; beyond, consecutive groups are merged into parts

NO_JOB, BLOCK, REPROJECT = 0, 1, 2  # Structure.job_kind codes
_JOB_KINDS = np.array([None, "block", "reproject"], dtype=object)  # by job_kind code
_READ_KINDS = np.array(["weights", "kv", "hidden"], dtype=object)  # by read id range


# ---------------------------------------------------------------------------------------------
# The problem in planner terms
# ---------------------------------------------------------------------------------------------
@dataclass
class Structure:
    """A recovery problem as grids (groups x chunks) and numbered reads.

    Reads are numbered: weights of g -> g; KV of (g, c) -> NG + g*NC + c; hidden state of
    (g, c) -> NG + NG*NC + g*NC + c (`read_id`, `read_ops`). Grids over the active groups
    (those with jobs) have one row per active group, in ascending order."""

    num_groups: int
    num_chunks: int
    job_kind: np.ndarray  # (NG, NC) NO_JOB, BLOCK (compute) or REPROJECT (rebuild KV from the input hidden state)
    job_s: np.ndarray  # (NG, NC) seconds of each job, 0 where there is none
    active: list[int]  # groups with jobs, ascending
    bundle_ids: list[np.ndarray]  # per active group: its gating reads, weights first, then in need order
    offsets: np.ndarray  # (m, NC) bundle-relative time job (g, c)'s own inputs are read
    bundle_s: np.ndarray  # (m,) read time of each bundle
    trailing_ids: np.ndarray  # reads no job waits for
    gating_need: np.ndarray  # (k, 2) per KV / hidden gating read: (group of the first job needing it, its chunk)
    kv_read: np.ndarray  # (NG, NC) KV the plan must read
    hidden_read: np.ndarray  # (NG, NC) hidden states the plan must read
    read_s_by_id: np.ndarray  # seconds of each numbered read
    costs: BlockCosts

    # --- numbered reads ---
    def read_id(self, op: ReadOp) -> int:
        what, g, c = op
        if what == "weights":
            return g
        NG, NC = self.num_groups, self.num_chunks
        if what == "kv":
            return NG + g * NC + c
        if what == "hidden":
            return NG + NG * NC + g * NC + c
        raise ValueError(f"unknown read {what!r}")

    def read_ids(self, reads: list[ReadOp]) -> np.ndarray:
        return np.fromiter((self.read_id(op) for op in reads), dtype=np.int64, count=len(reads))

    def read_ops(self, ids: np.ndarray) -> list[ReadOp]:
        NG, NC = self.num_groups, self.num_chunks
        what = (ids >= NG).astype(np.int64) + (ids >= NG + NG * NC)
        cell = (ids - NG) % (NG * NC)
        group = np.where(what == 0, ids, cell // NC)
        chunk = np.where(what == 0, -1, cell % NC)
        # (_make: the tuple constructor, without the keyword handling of ReadOp(...))
        return list(map(ReadOp._make, zip(_READ_KINDS[what].tolist(), group.tolist(), chunk.tolist(), strict=True)))

    # --- the same, as objects (tests, benchmarks, plans) ---
    @functools.cached_property
    def kind(self) -> dict[tuple[int, int], str]:
        """Every job: "block" (compute) or "reproject" (rebuild KV)."""
        g, c = np.nonzero(self.job_kind)
        return dict(
            zip(zip(g.tolist(), c.tolist(), strict=True), _JOB_KINDS[self.job_kind[g, c]].tolist(), strict=True)
        )

    @functools.cached_property
    def bundles(self) -> dict[int, list[ReadOp]]:
        return {g: self.read_ops(ids) for g, ids in zip(self.active, self.bundle_ids, strict=True)}

    @functools.cached_property
    def trailing(self) -> list[ReadOp]:
        return self.read_ops(self.trailing_ids)

    @property
    def total_read_s(self) -> float:
        return float(self.bundle_s.sum() + self.read_s_by_id[self.trailing_ids].sum())

    @property
    def total_job_s(self) -> float:
        return float(self.job_s.sum())


def _grid(cells: set[tuple[int, int]], shape: tuple[int, int]) -> np.ndarray:
    grid = np.zeros(shape, dtype=bool)
    if cells:
        flat = np.fromiter(itertools.chain.from_iterable(cells), dtype=np.int64, count=2 * len(cells))
        grid[flat[0::2], flat[1::2]] = True
    return grid


def analyse(problem: RecoveryProblem, costs: BlockCosts | None = None) -> Structure:
    costs = costs if costs is not None else BlockCosts.for_problem(problem)
    if costs.shape != (problem.num_groups, problem.num_chunks):
        raise ValueError(
            f"costs are for a {costs.shape} grid, the problem is {(problem.num_groups, problem.num_chunks)}"
        )
    NG, NC = problem.num_groups, problem.num_chunks
    assert costs.reproject is not None  # BlockCosts fills it in
    job_kind = np.zeros((NG, NC), dtype=np.int8)
    job_kind[_grid(problem.must_compute(), (NG, NC))] = BLOCK
    job_kind[_grid(problem.reprojections(), (NG, NC))] = REPROJECT
    kv_needed, hidden_needed = problem.needed_reads()
    kv_read, hidden_read = _grid(kv_needed, (NG, NC)), _grid(hidden_needed, (NG, NC))
    is_job, is_block = job_kind != NO_JOB, job_kind == BLOCK
    job_s = np.where(is_block, costs.compute, np.where(is_job, costs.reproject, 0.0))
    active = np.flatnonzero(is_job.any(axis=1))
    chunk = np.arange(NC)

    # next_block[g, c]: the first block compute of g after chunk c (NC if none)
    first_block_from = np.minimum.accumulate(np.where(is_block, chunk, NC)[:, ::-1], axis=1)[:, ::-1]
    next_block = np.concatenate([first_block_from[:, 1:], np.full((NG, 1), NC)], axis=1)
    # Gating reads, two per chunk at most, indexed by the group whose bundle they join:
    # KV of (g, c) when a later block of g reads it (needed at that block's chunk), and the input
    # hidden state of job (g, c), stored in (g-1, c)'s record (needed at chunk c).
    kv_gating = kv_read & (next_block < NC)
    hidden_gating = np.zeros((NG, NC), dtype=bool)
    hidden_gating[1:] = is_job[1:] & hidden_read[:-1]
    hidden_below = np.zeros((NG, NC))  # cost of the hidden read job (g, c) needs
    hidden_below[1:] = costs.hidden[:-1]
    kv_ids = NG + np.arange(NG * NC).reshape(NG, NC)
    hidden_ids = kv_ids + NG * NC - NC  # the hidden state of (g-1, c)
    gating = np.concatenate([kv_gating, hidden_gating], axis=1)[active]
    need = np.concatenate([next_block, np.broadcast_to(chunk, (NG, NC))], axis=1)[active]
    # Need order: by the chunk that needs it, KV before hidden on ties, then by chunk (unique).
    kv_then_hidden = np.repeat([0, 1], NC)
    key = np.where(gating, (need * 2 + kv_then_hidden) * NC + np.tile(chunk, 2), np.iinfo(np.int64).max)
    order = np.argsort(key, axis=1, kind="stable")  # gating reads first, in need order
    read_cost = np.concatenate([costs.kv, hidden_below], axis=1)[active]
    sorted_cost = np.where(np.take_along_axis(gating, order, axis=1), np.take_along_axis(read_cost, order, axis=1), 0.0)
    weights = costs.weights[active]
    # read_end[i, k]: bundle-relative end of the first k gating reads (after the weights)
    read_end = np.concatenate([weights[:, None], weights[:, None] + np.cumsum(sorted_cost, axis=1)], axis=1)
    bundle_s = read_end[:, -1].copy()
    # A block needs every gating read with need <= its chunk (a prefix of the need order); a
    # re-projection only the weights and its own input hidden state.
    row, col = np.nonzero(gating)
    need_of_gating = need[row, col]
    needed_by = np.bincount(row * NC + need_of_gating, minlength=len(active) * NC).reshape(len(active), NC)
    block_offset = np.take_along_axis(read_end, np.cumsum(needed_by, axis=1), axis=1)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.arange(2 * NC)[None, :], axis=1)
    own_hidden_end = np.take_along_axis(read_end, position[:, NC:] + 1, axis=1)
    reproject_offset = np.where(hidden_gating[active], own_hidden_end, weights[:, None])
    offsets = np.where(is_block[active], block_offset, np.where(is_job[active], reproject_offset, 0.0))
    sorted_ids = np.take_along_axis(np.concatenate([kv_ids, hidden_ids], axis=1)[active], order, axis=1)
    gating_count = gating.sum(axis=1)  # the gating reads sort first
    bundle_ids = [np.concatenate([[g], sorted_ids[i, : gating_count[i]]]) for i, g in enumerate(active.tolist())]
    gating_need = np.stack([active[row], need_of_gating], axis=1)

    # Trailing: per group, its weights if it computes nothing and its KV that no block reads;
    # then the hidden states no job reads (the first-token logits' input).
    trailing_weights = ~is_job.any(axis=1)
    trailing_kv = kv_read & ~kv_gating
    consumed_hidden = np.zeros((NG, NC), dtype=bool)
    consumed_hidden[:-1] = hidden_gating[1:]
    trailing_hidden = hidden_read & ~consumed_hidden
    per_group = np.concatenate([np.arange(NG)[:, None], kv_ids], axis=1)[
        np.concatenate([trailing_weights[:, None], trailing_kv], axis=1)
    ]
    trailing_ids = np.concatenate([per_group, (kv_ids + NG * NC)[trailing_hidden]])
    read_s_by_id = np.concatenate([costs.weights, costs.kv.ravel(), costs.hidden.ravel()])
    return Structure(
        NG,
        NC,
        job_kind,
        job_s,
        active.tolist(),
        bundle_ids,
        offsets,
        bundle_s,
        trailing_ids,
        gating_need,
        kv_read,
        hidden_read,
        read_s_by_id,
        costs,
    )


# ---------------------------------------------------------------------------------------------
# Compute order for given reads, and plans for a group order
# ---------------------------------------------------------------------------------------------
def _read_ends(s: Structure, read_orders: list[np.ndarray]) -> tuple[np.ndarray, list[float]]:
    """Per read order: the end time of each numbered read's first occurrence (inf if never read;
    the executor marks an input present on its first read), and the reader's finish."""
    end_by_id = np.full((len(read_orders), len(s.read_s_by_id)), np.inf)
    finish = []
    for row, ids in zip(end_by_id, read_orders, strict=True):
        ends = np.cumsum(s.read_s_by_id[ids])
        first_ids, first = np.unique(ids, return_index=True)
        row[first_ids] = ends[first]
        finish.append(float(ends[-1]) if len(ends) else 0.0)
    return end_by_id, finish


def _releases(s: Structure, job_kind: np.ndarray, end_by_id: np.ndarray) -> np.ndarray:
    """(k, NG, NC) for k read orders: the earliest time each job could start if the compute unit
    were always free -- its own inputs read, and the jobs it waits for released (propagated
    along dependencies). inf where an input is never read; undefined where there is no job."""
    NG, NC = s.num_groups, s.num_chunks
    k = len(end_by_id)
    weights_end = end_by_id[:, :NG]
    kv_end = end_by_id[:, NG : NG + NG * NC].reshape(k, NG, NC)
    hidden_end = end_by_id[:, NG + NG * NC :].reshape(k, NG, NC)
    is_job, is_block = job_kind != NO_JOB, job_kind == BLOCK
    # A block waits for the KV of every earlier chunk its group does not recompute.
    kv_ready = np.maximum.accumulate(np.where(is_job, 0.0, kv_end), axis=2)
    kv_ready_before = np.concatenate([np.zeros((k, NG, 1)), kv_ready[..., :-1]], axis=2)
    own = np.maximum(weights_end[..., None], np.where(is_block, kv_ready_before, 0.0))
    release = np.empty((k, NG, NC))
    for g in range(NG):
        r = own[:, g]
        if g > 0:  # the input: computed by the job below, else read from its record
            r = np.maximum(r, np.where(is_block[g - 1], release[:, g - 1], hidden_end[:, g - 1]))
        # a block also waits for every earlier job of its group (a re-projection does not)
        release[:, g] = np.where(is_block[g], np.maximum.accumulate(np.where(is_job[g], r, -np.inf), axis=1), r)
    return release


def _unread_input(s: Structure, job_kind: np.ndarray, end_by_id: np.ndarray, g: int, c: int) -> str:
    """What job (g, c) waits for that the reads never provide (for PlanError)."""
    NG, NC = s.num_groups, s.num_chunks
    if not np.isfinite(end_by_id[g]):
        return f"the weights of group {g}"
    if job_kind[g, c] == BLOCK:
        for cc in range(c):
            if job_kind[g, cc] == NO_JOB and not np.isfinite(end_by_id[NG + g * NC + cc]):
                return f"'{ReadOp('kv', g, cc)}'"
    return f"hidden g{g - 1} c{c}"


@dataclass
class _Timing:
    """Jobs and their release times under k read orders."""

    jobs: np.ndarray  # (2, J): group and chunk of every job, in (group, chunk) order
    release: np.ndarray  # (k, J)
    work: np.ndarray  # (J,) seconds of each job
    read_end: list[float]  # reader's finish, per read order

    def by_release(self, row: int) -> np.ndarray:
        """Job indices by release, ties in (group, chunk) order: the best compute order for the
        reads (docs/recovery.md §4)."""
        return np.argsort(self.release[row], kind="stable")

    def makespan(self, row: int, order: np.ndarray | None = None) -> float:
        """Makespan with the jobs run in `order` (default: (group, chunk), layer-first's own).
        Both that order and the release order run each job's dependencies before it, so a job
        starts at max(compute unit free, its own reads done), as simulate() has it; the compute
        unit finishes at max over k of release_k + the work from k on."""
        release, work = self.release[row], self.work
        if order is not None:
            release, work = release[order], work[order]
        compute_end = float(np.max(release + np.cumsum(work[::-1])[::-1])) if len(work) else 0.0
        return max(self.read_end[row], compute_end)


def _timing(s: Structure, job_kind: np.ndarray, read_orders: list[np.ndarray]) -> _Timing:
    """Release times of the jobs under each read order. Raises PlanError if some job's input is
    never read."""
    end_by_id, read_end = _read_ends(s, read_orders)
    release = _releases(s, job_kind, end_by_id)
    g, c = np.nonzero(job_kind)
    job_release = release[:, g, c]
    unread = ~np.isfinite(job_release)
    if unread.any():
        row, bad = (int(v[0]) for v in np.nonzero(unread))
        gg, cc = int(g[bad]), int(c[bad])
        missing = _unread_input(s, job_kind, end_by_id[row], gg, cc)
        raise PlanError(f"job g{gg} c{cc} waits for {missing}, never read")
    return _Timing(np.stack([g, c]), job_release, s.job_s[g, c], read_end)


def _layer_first_read_ids(s: Structure) -> np.ndarray:
    """plan.layer_first's read order as read ids: per group its weights, then per chunk its KV
    and its hidden state where they are read (tested to be the same order)."""
    NG, NC = s.num_groups, s.num_chunks
    ids = np.empty((NG, 1 + 2 * NC), dtype=np.int64)
    read = np.ones((NG, 1 + 2 * NC), dtype=bool)
    ids[:, 0] = np.arange(NG)
    ids[:, 1::2] = NG + np.arange(NG * NC).reshape(NG, NC)
    ids[:, 2::2] = ids[:, 1::2] + NG * NC
    read[:, 1::2], read[:, 2::2] = s.kv_read, s.hidden_read
    return ids[read]


def _chunk_first_read_ids(s: Structure) -> np.ndarray:
    """plan.chunk_first's read order as read ids: per chunk, per group, the group's weights at
    its first visit, its KV and its hidden state where read (tested to be the same order)."""
    NG, NC = s.num_groups, s.num_chunks
    ids = np.empty((NC, NG, 3), dtype=np.int64)
    read = np.zeros((NC, NG, 3), dtype=bool)
    ids[:, :, 0], read[0, :, 0] = np.arange(NG), True
    ids[:, :, 1] = (NG + np.arange(NG * NC).reshape(NG, NC)).T
    ids[:, :, 2] = ids[:, :, 1] + NG * NC
    read[:, :, 1], read[:, :, 2] = s.kv_read.T, s.hidden_read.T
    return ids[read]


def _compute_ops(job_kind: np.ndarray, jobs: np.ndarray) -> list[ComputeOp]:
    kinds = _JOB_KINDS[job_kind[jobs[0], jobs[1]]].tolist()
    return list(map(ComputeOp._make, zip(jobs[0].tolist(), jobs[1].tolist(), kinds, strict=True)))


def _kind_grid(kind: dict[tuple[int, int], str], shape: tuple[int, int]) -> np.ndarray:
    grid = np.zeros(shape, dtype=np.int8)
    for (g, c), k in kind.items():
        grid[g, c] = BLOCK if k == "block" else REPROJECT
    return grid


def release_times(
    problem: RecoveryProblem, reads: list[ReadOp], costs: BlockCosts, kind: dict[tuple[int, int], str] | None = None
) -> dict[tuple[int, int], float]:
    """Earliest time each job could start if the compute unit were always free: its own inputs
    read, and the jobs it waits for released (propagated along dependencies)."""
    s = analyse(problem, costs)
    job_kind = s.job_kind if kind is None else _kind_grid(kind, s.job_kind.shape)
    timing = _timing(s, job_kind, [s.read_ids(reads)])
    g, c = timing.jobs.tolist()
    return dict(zip(zip(g, c, strict=True), timing.release[0].tolist(), strict=True))


def best_compute_order(
    problem: RecoveryProblem, reads: list[ReadOp], costs: BlockCosts, kind: dict[tuple[int, int], str] | None = None
) -> list[ComputeOp]:
    """The job order with the least makespan for these reads: by release time, ties in
    (group, chunk) order. One machine with release times and precedence: an order sorted by
    precedence-propagated release that respects precedence meets the lower bound
    max_t (t + work released at or after t) -- docs/recovery.md §4."""
    s = analyse(problem, costs)
    job_kind = s.job_kind if kind is None else _kind_grid(kind, s.job_kind.shape)
    timing = _timing(s, job_kind, [s.read_ids(reads)])
    return _compute_ops(job_kind, timing.jobs[:, timing.by_release(0)])


def _group_order_ids(s: Structure, order: list[int]) -> np.ndarray:
    position = {g: i for i, g in enumerate(s.active)}
    return np.concatenate([s.bundle_ids[position[g]] for g in order] + [s.trailing_ids])


def plan_for_group_order(
    problem: RecoveryProblem,
    order: list[int],
    costs: BlockCosts | None = None,
    structure: Structure | None = None,
    name: str = "optimal",
) -> RecoveryPlan:
    """Bundles of the active groups in `order`, then the reads nothing waits for; best compute order."""
    s = structure or analyse(problem, costs)
    if sorted(order) != s.active:
        raise ValueError(f"order {order} is not a permutation of the groups to compute {s.active}")
    ids = _group_order_ids(s, order)
    timing = _timing(s, s.job_kind, [ids])
    return RecoveryPlan(name, s.read_ops(ids), _compute_ops(s.job_kind, timing.jobs[:, timing.by_release(0)]))


# ---------------------------------------------------------------------------------------------
# The batch tables P(a, g, b), h(a, g, b)
# ---------------------------------------------------------------------------------------------
@dataclass
class BatchTables:
    P: np.ndarray  # (n, n, n) [x, b, a]: compute time released by x's bundles after parts a..b but x
    h: np.ndarray  # (n, n, n) [x, b, a]: bundle start to the end of those jobs, compute unit free
    first_release: np.ndarray  # (n,) earliest part-relative time any job of x has its own inputs read
    bundle_s: np.ndarray  # (n,) read time of each part's bundles


def batch_tables(s: Structure, parts: list[list[int]] | None = None) -> BatchTables:
    """The tables over the n parts (runs of consecutive active groups whose bundles are read back
    to back; default: one group each), for a <= x <= b (other entries are not used)."""
    m, NC = len(s.active), s.num_chunks
    parts = parts if parts is not None else [[i] for i in range(m)]
    n = len(parts)
    part_of = np.empty(m, dtype=np.int64)
    for x, members in enumerate(parts):
        part_of[members] = x
    act = np.array(s.active, dtype=np.int64)
    T = s.job_kind[act] != NO_JOB  # jobs
    B = s.job_kind[act] == BLOCK  # ... of which block computes (they wait for earlier jobs)
    p = s.job_s[act]
    # Job (i, c) waits for (i-1, c) where group i-1 is the previous layer group and computes c.
    V = np.zeros((m, NC), dtype=bool)
    V[1:] = T[1:] & B[:-1] & (act[1:] == act[:-1] + 1)[:, None]
    # Rank each part's jobs by the time their own inputs are read, from the start of the part's
    # bundles: a job released by x's bundles starts no earlier than the latest-read x-job it
    # waits for (directly or through other jobs). Ties by (group, chunk).
    read_before = np.cumsum(s.bundle_s) - s.bundle_s  # bundles of earlier groups, read back to back
    part_start = read_before[[members[0] for members in parts]]
    job_group, job_chunk = np.nonzero(T)  # (positions among the active groups)
    t = read_before[job_group] - part_start[part_of[job_group]] + s.offsets[job_group, job_chunk]
    by_time = np.lexsort((job_chunk, job_group, t, part_of[job_group]))
    job_group, job_chunk, t = job_group[by_time], job_chunk[by_time], t[by_time]
    x_of = part_of[job_group]
    levels = np.bincount(x_of, minlength=n)  # jobs per part
    r = np.arange(len(t)) - (np.cumsum(levels) - levels)[x_of]
    rank = np.full((m, NC), -1, dtype=np.int64)  # -1: no job
    rank[job_group, job_chunk] = r
    level = np.zeros((n, int(levels.max())))  # level[x, r]: read time of x's r-th job by read time
    level[x_of, r] = t
    # K[i, x, c]: rank of the latest-read x-job that job (i, c) waits for (-1: none); a block
    # also waits for every earlier job of its group (running maximum), a re-projection does not.
    # A job waits for jobs of exactly the parts its dependency range meets: K >= 0 there.
    K = np.full((m, n, NC), -1, dtype=np.int64)
    for i in range(m):
        waits = np.where(V[i], K[i - 1], -1) if i > 0 else K[i].copy()
        waits[part_of[i]] = np.maximum(waits[part_of[i]], rank[i])
        K[i] = np.where(B[i], np.maximum.accumulate(waits, axis=1), waits)
    # Bin, per part x, the jobs x's bundles release by the run of parts they need -- [a, b] with
    # a <= x <= b holds a job iff its lowest part is >= a and its own part <= b -- and by rank.
    # Only the runs around x exist: (x + 1) x (n - x) of them, in one flat array, x after x.
    lowest_part = np.argmax(K >= 0, axis=1)  # (m, NC): the range is contiguous, from here to the job's own part
    ii, xi, cc = np.nonzero(K >= 0)
    below, above = xi - lowest_part[ii, cc], part_of[ii] - xi  # a = x - below, b = x + above
    # Per x, a block [below, above, (work, count), rank] of (x + 1) x (n - x) x 2 x levels[x],
    # the blocks back to back in one flat array.
    parts_x = np.arange(n)
    size = (parts_x + 1) * (n - parts_x) * 2 * levels
    start = np.cumsum(size) - size
    flat = start[xi] + ((below * (n - xi) + above) * 2) * levels[xi] + K[ii, xi, cc]
    total = int(size.sum())
    binned = np.bincount(flat, weights=p[ii, cc], minlength=total) + np.bincount(flat + levels[xi], minlength=total)
    P = np.zeros((n, n, n))
    h = np.full((n, n, n), -np.inf)
    for x in range(n):
        L = int(levels[x])
        runs = binned[start[x] : start[x] + size[x]].reshape(x + 1, -1)
        # Prefix sums as products with triangular matrices of ones (small matrix products are
        # several times cheaper than numpy's cumsum along inner axes): lowest part >= a ...
        runs = _ones_below(x + 1) @ runs
        # ... own part <= b ...
        runs = _ones_below(n - x) @ runs.reshape(x + 1, n - x, 2 * L)
        # ... and released at rank' >= rank.
        after = (runs.reshape(-1, L) @ _ones_below(L)).reshape(x + 1, n - x, 2, L)
        # the span: the latest read level any job of the batch waits for, plus the work from there on
        # (a level no job waits for is dominated by the next one that is)
        spans = np.where(after[:, :, 1] > 0, level[x, :L] + after[:, :, 0], -np.inf)
        P[x, x:, x::-1] = after[:, :, 0, 0].T
        h[x, x:, x::-1] = spans.max(axis=2).T
    bundle_s = np.bincount(part_of, weights=s.bundle_s, minlength=n)
    return BatchTables(P, h, level[:, 0].copy(), bundle_s)


@functools.lru_cache(maxsize=64)
def _ones_below(k: int) -> np.ndarray:
    """(k, k) ones on and below the diagonal: T @ x sums x[:i + 1] into row i; x @ T sums x[i:]."""
    return np.tri(k)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
@dataclass
class Solution:
    plan: RecoveryPlan
    makespan: float  # of `plan` (simulate() gives the same)
    group_order_makespan: float  # the DP's: least makespan over group orders
    group_order: list[int]  # active groups in bundle order (the DP's plan)
    chosen: str  # "group order", or the fixed read order that beat it
    exact: bool  # the DP covered every group order (else: orders of merged runs)
    read_end: float
    lower_bound: float
    seconds: float  # planning time


def solve(problem: RecoveryProblem, costs: BlockCosts | None = None, *, full: bool = False) -> Solution:
    """The fixed read orders (chunk-first, layer-first) with the best compute order, then the DP
    over group orders: a fixed order can interleave one group's reads between another's, outside
    the family the DP searches (docs/recovery.md §3), so the best of all three is kept.

    Fast paths (default): when layer-first's own plan meets the lower bound nothing can beat it
    and the DP is skipped (the common case: an interrupted prefill leaves a staircase); otherwise
    the DP runs as a branch and bound from the best fixed plan. `full=True` runs the whole DP
    without either shortcut, so that `group_order_makespan` is the exact optimum over group
    orders (tests, the family-gap benchmark)."""

    t0 = time.perf_counter()
    s = analyse(problem, costs)
    bound = lower_bound(problem, structure=s)
    read_end = s.total_read_s
    # The fixed read orders, timed on arrays; plans are built only for the one returned.
    fixed = _timing(s, s.job_kind, [_layer_first_read_ids(s), _chunk_first_read_ids(s)])
    LAYER_FIRST, CHUNK_FIRST = 0, 1
    plain_value = fixed.makespan(LAYER_FIRST)  # layer-first's own plan: its computes in (group, chunk) order

    def plain_plan() -> RecoveryPlan:
        plain = layer_first(problem)
        return RecoveryPlan("optimal", plain.reads, plain.computes)

    if not full and plain_value <= bound * (1 + 1e-9):
        # Layer-first's read order is dominated by the group order 0, 1, ... (§3), which
        # therefore meets the bound too: that is the best group order's makespan.
        return Solution(
            plain_plan(),
            plain_value,
            plain_value,
            list(s.active),
            "layer-first (meets the bound)",
            True,
            read_end,
            bound,
            time.perf_counter() - t0,
        )
    # The fixed read orders with the best compute order for them.
    fixed_best: tuple[float, int, str] = (np.inf, -1, "")
    for row, name in ((CHUNK_FIRST, "chunk-first reads"), (LAYER_FIRST, "layer-first reads")):
        value = fixed.makespan(row, fixed.by_release(row))
        if value < fixed_best[0] * (1 - 1e-12):
            fixed_best = (value, row, name)
    m = len(s.active)
    exact = m <= MAX_EXACT_GROUPS
    order_pos: list[int] = []
    compute_end = 0.0
    if m:
        best: tuple[float, list[int]] = (np.inf, [])
        for parts in partitions(m, MAX_EXACT_GROUPS):
            tables = batch_tables(s, parts)
            if full:
                part_order, finish = full_dp(len(parts), tables.P, tables.h, tables.bundle_s)
            else:  # only an order better than every plan in hand (or than an earlier alignment's) matters
                prune_at = min(fixed_best[0], plain_value, best[0])
                part_order, finish = pruned_dp(
                    len(parts), tables.P, tables.h, tables.bundle_s, tables.first_release, prune_at
                )
            if finish < best[0]:
                best = (finish, [i for x in part_order for i in parts[x]])
        compute_end, order_pos = best
    if np.isfinite(compute_end):
        order = [s.active[i] for i in order_pos]
        dp_makespan = max(compute_end, read_end)
    else:  # pruned: no group order beats the fixed plans; report the ascending order's value
        order = list(s.active)
        ascending = _timing(s, s.job_kind, [_group_order_ids(s, order)])
        dp_makespan = ascending.makespan(0, ascending.by_release(0))

    # The best of the three; the plan objects are built for the winner only.
    def group_order_plan() -> RecoveryPlan:
        return plan_for_group_order(problem, order, structure=s)

    def fixed_plan() -> RecoveryPlan:
        reads = (layer_first if fixed_row == LAYER_FIRST else chunk_first)(problem).reads
        return RecoveryPlan("optimal", reads, _compute_ops(s.job_kind, fixed.jobs[:, fixed.by_release(fixed_row)]))

    makespan, chosen, build = dp_makespan, "group order", group_order_plan
    fixed_value, fixed_row, fixed_chosen = fixed_best
    if fixed_row >= 0 and fixed_value < makespan * (1 - 1e-12):  # (no plan: value inf)
        makespan, chosen, build = fixed_value, fixed_chosen, fixed_plan
    # On a tie, run the plain layer-first plan: same makespan under the model, and an order that
    # operators (and the measurements beside it) already know.
    if plain_value <= makespan * (1 + 1e-9):
        makespan, chosen, build = plain_value, "layer-first (tie)", plain_plan
    return Solution(build(), makespan, dp_makespan, order, chosen, exact, read_end, bound, time.perf_counter() - t0)


def partitions(m: int, limit: int) -> list[list[list[int]]]:
    """Ways to cut m active groups into at most `limit` runs of consecutive groups: one group
    each when m <= limit; else runs of k = ceil(m / limit), tried at every alignment."""
    if m <= limit:
        return [[[i] for i in range(m)]]
    k = -(-m // limit)
    out = []
    for first in range(1, k + 1):
        cuts = [0] + list(range(first, m, k)) + [m]
        parts = [list(range(a, b)) for a, b in itertools.pairwise(cuts)]
        if len(parts) <= limit:
            out.append(parts)
    return out


def optimal(problem: RecoveryProblem) -> RecoveryPlan:
    """The planner registered as "optimal": the least-makespan group order under problem.costs
    (the reference payload's costs when the problem carries none)."""
    return solve(problem).plan


def lower_bound(problem: RecoveryProblem, costs: BlockCosts | None = None, structure: Structure | None = None) -> float:
    """A bound no plan (in any read order) can beat:
    total read time; total compute time;
    earliest possible first compute (weights + own inputs of a block with no computed input)
        + total compute time;
    total gating-read time + the least compute that must follow any one gating read (the
        rest of its group's blocks from the first one that needs it)."""
    s = structure or analyse(problem, costs)
    work = s.total_job_s
    bound = max(s.total_read_s, work)
    if not s.active:
        return bound
    costs, NC = s.costs, s.num_chunks
    is_job, is_block = s.job_kind != NO_JOB, s.job_kind == BLOCK
    block_below = np.zeros_like(is_block)
    block_below[1:] = is_block[:-1]
    # What a job reads itself: its weights; a block with no earlier job, the KV of every
    # earlier chunk; a job whose input is not computed, that input's hidden state.
    kv_before = np.concatenate([np.zeros((s.num_groups, 1)), np.cumsum(costs.kv, axis=1)[:, :-1]], axis=1)
    hidden_below = np.zeros_like(costs.hidden)
    hidden_below[1:] = costs.hidden[:-1]
    own_reads = costs.weights[:, None] + np.where(is_block, kv_before, 0.0) + np.where(block_below, 0.0, hidden_below)
    first_job = np.argmax(is_job, axis=1)
    waits_for_earlier = is_block & (first_job[:, None] < np.arange(NC))
    is_source = is_job & ~waits_for_earlier & ~block_below
    first_start = float(own_reads[is_source].min())
    # The least work that waits for a gating read: all of its group's jobs for weights; for a KV
    # or hidden read, the first job needing it and every later block of that group.
    block_work = np.where(is_block, s.job_s, 0.0)
    blocks_after = np.concatenate(
        [np.cumsum(block_work[:, ::-1], axis=1)[:, ::-1][:, 1:], np.zeros((s.num_groups, 1))], axis=1
    )
    least_after = float(s.job_s[s.active].sum(axis=1).min())
    if len(s.gating_need):
        g, c = s.gating_need[:, 0], s.gating_need[:, 1]
        least_after = min(least_after, float((s.job_s[g, c] + blocks_after[g, c]).min()))
    return max(bound, first_start + work, float(s.bundle_s.sum()) + least_after)


def register(planners: dict = PLANNERS) -> None:
    planners["optimal"] = optimal


register()
