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
  is exact; the makespan is max(f(all), total read time).

Above MAX_EXACT_GROUPS groups with something to compute (G = 1 on a 36-layer model), runs of k
consecutive groups are merged into parts whose bundles are read back to back, and the same DP
orders the parts -- exact over those orders, not over all group orders (`Solution.exact`).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import dataclass

import numpy as np

from .cost import BlockCosts
from .plan import PLANNERS, ComputeOp, PlanError, ReadOp, RecoveryPlan, RecoveryProblem, chunk_first, layer_first
from .simulate import read_timeline, simulate

MAX_EXACT_GROUPS = 20  # 2^20 sets: ~0.15-0.25 s here; beyond, consecutive groups are merged into parts
_CACHED_TRANSITIONS_UP_TO = 18  # problem-independent transitions kept in memory (~19 MB at 18)


# ---------------------------------------------------------------------------------------------
# The problem in planner terms
# ---------------------------------------------------------------------------------------------
@dataclass
class Structure:
    num_groups: int
    num_chunks: int
    kind: dict[tuple[int, int], str]  # every job: "block" (compute) or "reproject" (rebuild KV)
    jobs: dict[int, list[int]]  # chunks of each group's jobs, ascending
    active: list[int]  # groups with jobs, ascending
    bundles: dict[int, list[ReadOp]]  # gating reads of each active group, in need order
    need: dict[ReadOp, int]  # gating read -> chunk of the first job needing it
    offsets: np.ndarray  # (m, NC) bundle-relative time job (g, c)'s own inputs are read
    bundle_s: np.ndarray  # (m,) read time of each bundle
    trailing: list[ReadOp]  # reads no job waits for
    costs: BlockCosts

    @property
    def total_read_s(self) -> float:
        return float(self.bundle_s.sum()) + sum(self.costs.read_s(op) for op in self.trailing)

    def job_times(self) -> dict:
        """Every job's time, looked up once (the bound and the tables ask for each many times)."""
        times = self.__dict__.get("_job_times")
        if times is None:
            compute_s = self.costs.compute_s
            times = self.__dict__["_job_times"] = {b: compute_s(b[0], b[1], k) for b, k in self.kind.items()}
        return times

    def job_s(self, g: int, c: int) -> float:
        return self.job_times()[(g, c)]

    @property
    def total_job_s(self) -> float:
        return float(sum(self.job_times().values()))


def analyse(problem: RecoveryProblem, costs: BlockCosts | None = None) -> Structure:
    costs = costs if costs is not None else BlockCosts.for_problem(problem)
    if costs.shape != (problem.num_groups, problem.num_chunks):
        raise ValueError(
            f"costs are for a {costs.shape} grid, the problem is {(problem.num_groups, problem.num_chunks)}"
        )
    NG, NC = problem.num_groups, problem.num_chunks
    kind = {b: "block" for b in problem.must_compute()}
    kind.update({b: "reproject" for b in problem.reprojections()})
    kv_needed, hidden_needed = problem.needed_reads()
    jobs: dict[int, list[int]] = {g: [] for g in range(NG)}
    for g, c in sorted(kind):
        jobs[g].append(c)
    active = [g for g in range(NG) if jobs[g]]
    bundles, need, trailing = {}, {}, []
    offset_rows = [[0.0] * NC for _ in active]
    bundle_seconds = [0.0] * len(active)
    weights = costs.weights.tolist()
    read_s = costs.read_s
    for i, g in enumerate(active):
        # next_block[c]: the first block compute of g after chunk c (NC if none)
        next_block, nxt = [NC] * NC, NC
        for c in range(NC - 1, -1, -1):
            next_block[c] = nxt
            if kind.get((g, c)) == "block":
                nxt = c
        # (chunk of the first job needing it, KV before hidden, chunk, op)
        candidates: list[tuple[int, int, int, ReadOp]] = []
        for c in range(NC):
            if next_block[c] < NC and (g, c) in kv_needed:  # a block computed after c reads this KV
                candidates.append((next_block[c], 0, c, ReadOp("kv", g, c)))
            if g > 0 and (g, c) in kind and (g - 1, c) in hidden_needed:
                candidates.append((c, 1, c, ReadOp("hidden", g - 1, c)))
        candidates.sort()  # the first three fields are unique per read: ops are never compared
        gating = [(needed_at, order, op) for needed_at, order, _, op in candidates]
        bundles[g] = [ReadOp("weights", g)] + [op for _, _, op in gating]
        # Bundle-relative time each job's inputs are read: a block needs every read with need
        # <= its chunk (a prefix, in this order); a re-projection only the weights and its own
        # input hidden state, so its offset may be below an earlier block's.
        ends, t = {}, weights[g]
        for _, _, op in gating:
            t += read_s(op)
            ends[op] = t
        prefix = weights[g]
        k = 0
        row = offset_rows[i]
        for c in jobs[g]:
            while k < len(gating) and gating[k][0] <= c:
                prefix = ends[gating[k][2]]
                k += 1
            row[c] = prefix if kind[(g, c)] == "block" else ends.get(ReadOp("hidden", g - 1, c), weights[g])
        bundle_seconds[i] = t
        for ch, _, op in gating:
            need[op] = ch
        need[ReadOp("weights", g)] = jobs[g][0]
    for g in range(NG):
        for op in [ReadOp("weights", g)] + [ReadOp("kv", g, c) for c in range(NC) if (g, c) in kv_needed]:
            if op not in need:
                trailing.append(op)
    trailing += [ReadOp("hidden", g, c) for (g, c) in sorted(hidden_needed) if ReadOp("hidden", g, c) not in need]
    offsets = np.array(offset_rows, dtype=np.float64).reshape(len(active), NC)
    bundle_s = np.array(bundle_seconds, dtype=np.float64)
    return Structure(NG, NC, kind, jobs, active, bundles, need, offsets, bundle_s, trailing, costs)


# ---------------------------------------------------------------------------------------------
# Compute order for given reads, and plans for a group order
# ---------------------------------------------------------------------------------------------
def release_times(
    problem: RecoveryProblem, reads: list[ReadOp], costs: BlockCosts, kind: dict[tuple[int, int], str] | None = None
) -> dict[tuple[int, int], float]:
    """Earliest time each job could start if the compute unit were always free: its own inputs
    read, and the jobs it waits for released (propagated along dependencies)."""
    if kind is None:
        kind = {b: "block" for b in problem.must_compute()} | {b: "reproject" for b in problem.reprojections()}
    read_end, _, _ = read_timeline(reads, costs)
    release: dict[tuple[int, int], float] = {}
    for g in range(problem.num_groups):
        weights = read_end.get(ReadOp("weights", g))
        kv_ready, kv_unread, earlier_jobs = 0.0, None, 0.0
        for c in range(problem.num_chunks):
            k = kind.get((g, c))
            if k is None:
                end = read_end.get(ReadOp("kv", g, c))
                if end is None:
                    kv_unread = kv_unread or ReadOp("kv", g, c)
                else:
                    kv_ready = max(kv_ready, end)
                continue
            if weights is None:
                raise PlanError(f"job g{g} c{c} waits for the weights of group {g}, never read")
            r = weights
            if k == "block":
                if kv_unread is not None:
                    raise PlanError(f"compute g{g} c{c} waits for '{kv_unread}', never read")
                r = max(r, kv_ready, earlier_jobs)
            if g > 0:
                if kind.get((g - 1, c)) == "block":
                    r = max(r, release[(g - 1, c)])
                else:
                    end = read_end.get(ReadOp("hidden", g - 1, c))
                    if end is None:
                        raise PlanError(f"job g{g} c{c} waits for hidden g{g - 1} c{c}, never read")
                    r = max(r, end)
            release[(g, c)] = r
            earlier_jobs = max(earlier_jobs, r)
    return release


def best_compute_order(
    problem: RecoveryProblem, reads: list[ReadOp], costs: BlockCosts, kind: dict[tuple[int, int], str] | None = None
) -> list[ComputeOp]:
    """The job order with the least makespan for these reads: by release time, ties in
    (group, chunk) order. One machine with release times and precedence: an order sorted by
    precedence-propagated release that respects precedence meets the lower bound
    max_t (t + work released at or after t) -- docs/recovery.md §4."""
    if kind is None:
        kind = {b: "block" for b in problem.must_compute()} | {b: "reproject" for b in problem.reprojections()}
    release = release_times(problem, reads, costs, kind)
    return [ComputeOp(g, c, kind[(g, c)]) for (g, c) in sorted(release, key=lambda b: (release[b], b))]


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
    reads = [op for g in order for op in s.bundles[g]] + s.trailing
    return RecoveryPlan(name, reads, best_compute_order(problem, reads, s.costs, s.kind))


# ---------------------------------------------------------------------------------------------
# The batch tables P(a, g, b), h(a, g, b)
# ---------------------------------------------------------------------------------------------
def batch_tables(s: Structure, parts: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(P, h), each (n, n, n) indexed [x, b, a] over the n parts (runs of consecutive active
    groups whose bundles are read back to back; default: one group each), for a <= x <= b:
    P = compute time of the jobs released when x's bundle is read while parts a..b other than x
    are already read; h = bundle start to the end of those jobs if the compute unit were free."""
    m, NC = len(s.active), s.num_chunks
    parts = parts if parts is not None else [[i] for i in range(m)]
    n = len(parts)
    part_of = np.empty(m, dtype=np.int64)
    for x, members in enumerate(parts):
        part_of[members] = x
    act = np.array(s.active)
    T = np.zeros((m, NC), dtype=bool)  # jobs
    B = np.zeros((m, NC), dtype=bool)  # ... of which block computes (they wait for earlier jobs)
    p = np.zeros((m, NC))
    pos = {g: i for i, g in enumerate(s.active)}
    for (g, c), k in s.kind.items():
        T[pos[g], c] = True
        B[pos[g], c] = k == "block"
        p[pos[g], c] = s.job_s(g, c)
    # Job (i, c) waits for (i-1, c) where group i-1 is the previous layer group and computes c.
    V = np.zeros((m, NC), dtype=bool)
    for i in range(1, m):
        if act[i - 1] == act[i] - 1:
            V[i] = T[i] & B[i - 1]
    # lo[i, c]: lowest group (position) in the dependency range of job (i, c); a block also
    # waits for every earlier job of its group (running minimum), a re-projection does not.
    big = m + 1
    lo = np.full((m, NC), big)
    for i in range(m):
        y = np.where(T[i], i, big)
        if i > 0:
            y = np.where(V[i], np.minimum(y, lo[i - 1]), y)
        lo[i] = np.where(B[i], np.minimum.accumulate(y), y)
    # Rank each part's jobs by the time their own inputs are read, from the start of the part's
    # bundles: a job released by x's bundles starts no earlier than the latest-read x-job it
    # waits for (directly or through other jobs).
    rank = np.full((m, NC), -1, dtype=np.int64)
    width = max(sum(len(s.jobs[s.active[i]]) for i in members) for members in parts)
    level = np.zeros((n, width))  # level[x, r]: read time of x's r-th job by read time
    for x, members in enumerate(parts):
        before = np.concatenate([[0.0], np.cumsum(s.bundle_s[members])[:-1]])
        xjobs = sorted((before[k] + s.offsets[i, c], i, c) for k, i in enumerate(members) for c in s.jobs[s.active[i]])
        for r, (t, i, c) in enumerate(xjobs):
            rank[i, c] = r
            level[x, r] = t
    # K[x, i, c]: rank of the latest-read x-job that job (i, c) waits for (-1: none); a block
    # also waits for every earlier job of its group (running maximum), a re-projection does not.
    K = np.full((n, m, NC), -1, dtype=np.int64)
    for i in range(m):
        waits = np.where(V[i][None, :], K[:, i - 1, :], -1) if i > 0 else np.full((n, NC), -1, dtype=np.int64)
        own = part_of[i]
        waits[own] = np.maximum(waits[own], np.where(T[i], rank[i], -1))
        K[:, i, :] = np.where(B[i][None, :], np.maximum.accumulate(waits, axis=1), np.where(T[i][None, :], waits, -1))
    xi, ii, cc = np.nonzero(K >= 0)
    flat = ((xi * n + part_of[ii]) * n + part_of[lo[ii, cc]]) * width + K[xi, ii, cc]
    size = n * n * n * width
    work = np.bincount(flat, weights=p[ii, cc], minlength=size).reshape(n, n, n, width)  # [x, part, lo, rank]
    count = np.bincount(flat, minlength=size).reshape(n, n, n, width)

    def upto_b_from_a(v):  # sum over parts <= b (axis 1), over lo >= a (axis 2)
        v = np.cumsum(v, axis=1)
        return np.flip(np.cumsum(np.flip(v, axis=2), axis=2), axis=2)

    work, count = upto_b_from_a(work), upto_b_from_a(count)
    after = np.flip(np.cumsum(np.flip(work, axis=3), axis=3), axis=3)  # work released at rank' >= rank
    spans = np.where(count > 0, level[:, None, None, :] + after, -np.inf)
    return after[..., 0], spans.max(axis=3)


# ---------------------------------------------------------------------------------------------
# The subset DP
# ---------------------------------------------------------------------------------------------
def _run_bounds(sets: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """For sets without bit g: (a, b) with bits a..g-1 and g+1..b set and a-1, b+1 clear."""
    below = ~sets & ((1 << g) - 1)  # clear bits under g; the highest ends the run
    # frexp gives exponent e with 2^(e-1) <= x < 2^e: e = highest set bit + 1, and 0 for x = 0.
    a = np.frexp(_highest_bit(below).astype(np.float64))[1]
    above = ~sets >> (g + 1)  # has a set bit: sets are < 2^m
    b = g + np.frexp((above & -above).astype(np.float64))[1] - 1
    return a, b


def _highest_bit(x: np.ndarray) -> np.ndarray:
    """Isolate the highest set bit (exact in float64 for any int64, unlike x itself)."""
    x = x.copy()
    for shift in (1, 2, 4, 8, 16, 32):
        x |= x >> shift
    return x - (x >> 1)


@functools.lru_cache(maxsize=2)
def _transitions(m: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """For each size k and group g: the sets of size k without g, and the (g, b, a) table index
    of adding g to them. Problem-independent, so cached per group count."""
    return [[_layer_transitions(m, k, g) for g in range(m)] for k in range(m)]


@functools.lru_cache(maxsize=2)
def _subsets_by_size(n: int) -> tuple[np.ndarray, np.ndarray]:
    sets = np.arange(1 << n, dtype=np.int64)
    size = np.bitwise_count(sets)
    order = np.argsort(size, kind="stable")
    return sets[order], np.searchsorted(size[order], np.arange(n + 2))


def _layer_transitions(m: int, k: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    others, bounds = _subsets_by_size(m - 1)
    sub = others[bounds[k] : bounds[k + 1]]
    sets = ((sub >> g) << (g + 1)) | (sub & ((1 << g) - 1))  # insert a clear bit at g
    a, b = _run_bounds(sets, g)
    return sets.astype(np.int32), ((g * m + b) * m + a).astype(np.int32)


def _exact_dp(
    m: int, P: np.ndarray, h: np.ndarray, bundle_s: np.ndarray, bound: float = np.inf
) -> tuple[list[int], float]:
    """Least compute finish over all orders of the m parts, and one order reaching it.

    With a finite `bound` (the makespan of a plan already in hand), a set S whose jobs cannot
    finish before the bound -- f(S) + the work still to release >= bound -- is not extended: no
    order through S beats what is in hand. Returns ([], inf) when nothing beats the bound."""
    kernel = _compiled_kernel() if m > NUMPY_DP_UP_TO else None
    P, h = np.ascontiguousarray(P.reshape(-1), dtype=np.float64), np.ascontiguousarray(h.reshape(-1), dtype=np.float64)
    bundle_s = np.ascontiguousarray(bundle_s, dtype=np.float64)
    if kernel is not None:
        finish, last = kernel(m, P, h, bundle_s, float(bound))
    else:
        finish, last = _numpy_dp(m, P, h, bundle_s)
    full = (1 << m) - 1
    if not np.isfinite(finish[full]):
        return [], float("inf")
    order, S = [], full
    while S:
        g = int(last[S])
        order.append(g)
        S ^= 1 << g
    return order[::-1], float(finish[full])


def _numpy_dp(m: int, P: np.ndarray, h: np.ndarray, bundle_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same DP vectorised per set size with numpy (no pruning): the fallback where the
    compiled kernel is unavailable, and the cross-check of the tests."""
    n = 1 << m
    finish = np.full(n, np.inf)
    finish[0] = 0.0
    last = np.full(n, -1, dtype=np.int8)
    read = np.zeros(1)
    for g in range(m):  # read[S] = sum of bundle times in S (bit g <-> upper half after step g)
        read = np.concatenate([read, read + bundle_s[g]])
    table = _transitions(m) if m <= _CACHED_TRANSITIONS_UP_TO else None
    for k in range(m):
        for g in range(m):
            sets, tri = table[k][g] if table is not None else _layer_transitions(m, k, g)
            cand = np.maximum(finish[sets] + P[tri], read[sets] + h[tri])
            nxt = sets | (1 << g)
            better = cand < finish[nxt]
            upd = nxt[better]
            finish[upd] = cand[better]
            last[upd] = g
    return finish, last


_KERNEL: list = []
#: Parts up to which the numpy DP plans: it takes milliseconds there (2^12 sets), while the first
#: use of the compiled kernel in a process imports numba and loads the cached machine code, 1.5-4 s
#: on a 2-core CPU. A payload pays that at every boot after a cut; in a short window that is the
#: whole window (measured in the short-window campaign, docs/recovery.md §4).
NUMPY_DP_UP_TO = 12


def _compiled_kernel():
    """The DP as a compiled loop (flight/recovery/dp_kernel.py, numba), or None where numba is
    unavailable or OW_PLANNER_NO_JIT is set (then the numpy version runs)."""
    if not _KERNEL:
        kernel = None
        if not os.environ.get("OW_PLANNER_NO_JIT"):
            try:
                from .dp_kernel import subset_dp as kernel
            except ImportError:  # pragma: no cover - numba is a dependency; plan without it anyway
                kernel = None
        _KERNEL.append(kernel)
    return _KERNEL[0]


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
    the DP prunes every set that cannot finish before the best fixed plan. `full=True` runs the
    whole DP without either shortcut, so that `group_order_makespan` is the exact optimum over
    group orders (tests, the family-gap benchmark)."""

    t0 = time.perf_counter()
    s = analyse(problem, costs)
    bound = lower_bound(problem, structure=s)
    read_end = s.total_read_s
    plain = layer_first(problem)
    plain_value = simulate(plain, problem, s.costs).makespan
    as_optimal = RecoveryPlan("optimal", plain.reads, plain.computes)
    if not full and plain_value <= bound * (1 + 1e-9):
        # Layer-first's read order is dominated by the group order 0, 1, ... (§3), which
        # therefore meets the bound too: that is the best group order's makespan.
        return Solution(
            as_optimal,
            plain_value,
            plain_value,
            list(s.active),
            "layer-first (meets the bound)",
            True,
            read_end,
            bound,
            time.perf_counter() - t0,
        )
    fixed_best: tuple[float, RecoveryPlan | None, str] = (np.inf, None, "")
    for fixed in (chunk_first, layer_first):
        reads = fixed(problem).reads
        candidate = RecoveryPlan("optimal", reads, best_compute_order(problem, reads, s.costs, s.kind))
        value = simulate(candidate, problem, s.costs).makespan
        if value < fixed_best[0] * (1 - 1e-12):
            fixed_best = (value, candidate, f"{fixed.__name__.replace('_', '-')} reads")
    m = len(s.active)
    exact = m <= MAX_EXACT_GROUPS
    order_pos: list[int] = []
    compute_end = 0.0
    if m:
        best: tuple[float, list[int]] = (np.inf, [])
        prune_at = np.inf if full else min(fixed_best[0], plain_value)
        for parts in partitions(m, MAX_EXACT_GROUPS):
            P, h = batch_tables(s, parts)
            part_order, finish = _exact_dp(len(parts), P, h, _part_bundles(s, parts), prune_at)
            if finish < best[0]:
                best = (finish, [i for x in part_order for i in parts[x]])
        compute_end, order_pos = best
    if np.isfinite(compute_end):
        order = [s.active[i] for i in order_pos]
        dp_makespan = max(compute_end, read_end)
        plan, makespan, chosen = plan_for_group_order(problem, order, structure=s), dp_makespan, "group order"
    else:  # pruned: no group order beats the fixed plans; report the ascending order's value
        order = list(s.active)
        plan = plan_for_group_order(problem, order, structure=s)
        dp_makespan = makespan = simulate(plan, problem, s.costs).makespan
        chosen = "group order"
    fixed_value, fixed_plan, fixed_chosen = fixed_best
    if fixed_plan is not None and fixed_value < makespan * (1 - 1e-12):  # (no plan: value inf)
        makespan, plan, chosen = fixed_value, fixed_plan, fixed_chosen
    # On a tie, run the plain layer-first plan: same makespan under the model, and an order that
    # operators (and the measurements beside it) already know.
    if plain_value <= makespan * (1 + 1e-9):
        plan, makespan, chosen = as_optimal, plain_value, "layer-first (tie)"
    return Solution(plan, makespan, dp_makespan, order, chosen, exact, read_end, bound, time.perf_counter() - t0)


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


def _part_bundles(s: Structure, parts: list[list[int]]) -> np.ndarray:
    return np.array([s.bundle_s[members].sum() for members in parts])


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
    if not s.kind:
        return bound
    read_s = s.costs.read_s

    def own_reads(g: int, c: int) -> float:  # what job (g, c) itself reads
        t = read_s(ReadOp("weights", g))
        if s.kind[(g, c)] == "block":
            t += sum(read_s(ReadOp("kv", g, cc)) for cc in range(c))  # a source block has no earlier job
        if g > 0 and s.kind.get((g - 1, c)) != "block":
            t += read_s(ReadOp("hidden", g - 1, c))
        return t

    def is_source(g: int, c: int) -> bool:
        earlier = s.kind[(g, c)] == "block" and s.jobs[g][0] < c
        return not earlier and s.kind.get((g - 1, c)) != "block"

    first_start = min(own_reads(g, c) for (g, c) in s.kind if is_source(g, c))

    # blocks_after[g][c]: block work of group g after chunk c (it waits for everything before it)
    blocks_after = {}
    for g in s.active:
        acc, after = 0.0, [0.0] * s.num_chunks
        for c in reversed(range(s.num_chunks)):
            after[c] = acc
            if s.kind.get((g, c)) == "block":
                acc += s.job_s(g, c)
        blocks_after[g] = after

    def work_after(op: ReadOp, need: int) -> float:  # least work that waits for `op` once read
        g = op.group + 1 if op.what == "hidden" else op.group
        if op.what == "weights":
            return float(sum(s.job_s(g, c) for c in s.jobs[g]))
        return s.job_s(g, need) + blocks_after[g][need]

    least_after = min(work_after(op, need) for op, need in s.need.items())
    return max(bound, first_start + work, float(s.bundle_s.sum()) + least_after)


def register(planners: dict = PLANNERS) -> None:
    planners["optimal"] = optimal


register()
