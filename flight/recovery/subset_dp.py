"""The optimal planner's subset DP over orders of parts (docs/recovery.md §4), in numpy.

    f(S + g) = max(f(S) + P[g, b, a], R(S) + h[g, b, a])

where R(S) is the read time of S's bundles and [a, b] the run of consecutive parts of S + g
around g. Two ways to run it:

* `full_dp`: every set, vectorised per set size. Exact and unpruned: the reference the tests
  compare the pruned version with (`solve(full=True)`).
* `pruned_dp`: branch and bound from a plan already in hand (the payload's path). Sets are
  expanded level by level (by size); a set whose jobs cannot finish before the best value known
  is dropped, and a set after which the compute unit can no longer wait for a read is finished
  at once. Both rules are exact (the proofs are in `_search`'s docstring); on the recovery
  problems of a 36-layer model with G = 2 a few hundred to a few thousand sets of the 2^18 are
  visited (the most where the plan in hand is already optimal and the search must prove it).

Plain numpy, no compiled kernel: a payload plans at every boot after a power cut, and a kernel
compiled then (or loaded from a compiler cache that a power cut can leave torn) costs seconds
of that boot, or fails it.
"""

from __future__ import annotations

import functools

import numpy as np


# ---------------------------------------------------------------------------------------------
# Runs of consecutive parts around an added part, from the set's bits
# ---------------------------------------------------------------------------------------------
def _trailing_ones(x: np.ndarray) -> np.ndarray:
    """Number of consecutive set bits from bit 0 up (x & ~(x + 1) keeps exactly those bits)."""
    return np.bitwise_count(x & ~(x + 1)).astype(np.int64)


def _run_bounds(sets: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """For sets without bit g: (a, b) with bits a..g-1 and g+1..b set and a-1, b+1 clear."""
    below = ~sets & ((1 << g) - 1)  # clear bits under g; the highest ends the run
    # frexp gives exponent e with 2^(e-1) <= x < 2^e: e = highest set bit + 1, and 0 for x = 0
    # (exact: the sets here have at most 20 bits).
    a = np.frexp(below.astype(np.float64))[1]
    b = g + _trailing_ones(sets >> (g + 1))
    return a, b


# ---------------------------------------------------------------------------------------------
# Every set (reference)
# ---------------------------------------------------------------------------------------------
_CACHED_TRANSITIONS_UP_TO = 18  # problem-independent transitions kept in memory (~19 MB at 18)


@functools.lru_cache(maxsize=2)
def _transitions(m: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """For each size k and part g: the sets of size k without g, and the (g, b, a) table index
    of adding g to them. Problem-independent, so cached per part count."""
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


def full_dp(m: int, P: np.ndarray, h: np.ndarray, bundle_s: np.ndarray) -> tuple[list[int], float]:
    """Least compute finish over all orders of the m parts, and one order reaching it (ties: the
    least predecessor set, then the least part), visiting all 2^m sets."""
    P, h = P.reshape(-1), h.reshape(-1)
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
    order, S = [], n - 1
    while S:
        g = int(last[S])
        order.append(g)
        S ^= 1 << g
    return order[::-1], float(finish[n - 1])


# ---------------------------------------------------------------------------------------------
# Branch and bound (the payload's path)
# ---------------------------------------------------------------------------------------------
BEAM_WIDTH = 8  # sets kept per size in the first, heuristic pass


def pruned_dp(
    m: int, P: np.ndarray, h: np.ndarray, bundle_s: np.ndarray, first_release: np.ndarray, bound: float
) -> tuple[list[int], float]:
    """The least compute finish below `bound` over all orders of the m parts, and one order
    reaching it; ([], inf) when no order finishes before `bound` (the plan in hand is optimal).

    `first_release[x]`: the earliest time, from the start of part x's bundles, at which any
    job of x has its own inputs read (the least of its batch offsets).

    Two passes of the same search (`_search`). The first keeps only the BEAM_WIDTH most
    promising sets of each size: a heuristic that reaches a near-optimal order (usually the
    optimum) in a few hundred transitions. The second is exact: it keeps every set that could
    still beat that order, so with a good order in hand it visits a few hundred to a few
    thousand sets of the 2^m. (A staircase-like frontier leaves the fixed plans a few per cent above the optimum; from
    that bound alone the exact pass would visit ~10^5 sets.)"""
    search = functools.partial(_search, m, P.reshape(-1), h.reshape(-1), bundle_s, first_release)
    heuristic = search(bound, beam=BEAM_WIDTH)
    exact = search(min(bound, heuristic[1]), beam=None)
    return exact if exact[0] else heuristic


def _search(
    m: int,
    P: np.ndarray,
    h: np.ndarray,
    bundle_s: np.ndarray,
    first_release: np.ndarray,
    bound: float,
    beam: int | None,
) -> tuple[list[int], float]:
    """The DP from the empty set up, by set size, each set kept with its least finish f(S)
    (ties: the least predecessor set, then the least part, as in `full_dp`). Returns the best
    order strictly below `bound`, or ([], inf). Without `beam` it is exact; with one, only the
    `beam` sets of each size with the least bound below are extended.

    Two exact rules skip most sets:

    * Bound. Every job not yet released after S needs a bundle not in S, so it starts no earlier
      than R(S) + the least first_release of the parts outside S, and no earlier than f(S) (jobs
      run in release order, and S's were released by R(S)). Any order through S therefore
      finishes no earlier than max(f(S), R(S) + that release) + the work still to release; a set
      where that is no better than the best value known is dropped.
    * Saturation. Once f(S) >= the read time of all bundles, every later batch is released
      before the compute unit is free (a batch's release is at most its part's bundle end), so
      each step adds exactly its work: every completion finishes at f(S) + the work left. Such a
      set is finished at once (the rest in ascending order) and offered as the best value known.
    """
    parts = np.arange(m, dtype=np.int64)
    bit = np.int64(1) << parts
    total_work = float(P[(parts * m + parts) * m].sum())  # what the ascending order releases
    all_read = float(bundle_s.sum())
    # Each set is carried as three bit masks: the set itself; the same parts in ascending
    # first_release order (the least first_release outside the set is then the entry at its
    # count of trailing ones); and mirrored (part x at bit m-1-x: the run of the set's parts
    # just below an added part is then the mirror's trailing ones, as the run above is the
    # plain mask's).
    by_release = np.argsort(first_release, kind="stable")
    release_bit = np.empty(m, dtype=np.int64)
    release_bit[by_release] = bit
    next_release = np.append(first_release[by_release], -np.inf)  # -inf: nothing left to release
    SET, BY_RELEASE, MIRRORED = 0, 1, 2
    part_bits = np.stack([bit, release_bit, bit[::-1]])  # (3, m): what adding part x sets in each mask
    FINISH, WORK, READ = 0, 1, 2  # f(S), work released, read time R(S)

    masks = np.zeros((3, 1), dtype=np.int64)  # the sets of the current size
    values = np.zeros((3, 1))
    history: list[tuple[np.ndarray, np.ndarray]] = []  # per size: (index of the predecessor, part added)
    best_value, best_finished = bound, None  # (size, predecessor index, part) of the best finished set
    for size in range(m):
        if not masks.shape[1]:
            break
        # every (set, part not in it)
        src, g = np.divmod(np.flatnonzero((masks[SET][:, None] & bit) == 0), m)
        before, carried = masks[:, src], values[:, src]
        b = g + _trailing_ones(before[SET] >> (g + 1))
        a = g - _trailing_ones(before[MIRRORED] >> (m - g))
        idx = (g * m + b) * m + a
        step_work = P[idx]
        after = before | part_bits[:, g]
        finish = np.maximum(carried[FINISH] + step_work, carried[READ] + h[idx])
        work = carried[WORK] + step_work
        work_left = total_work - work
        read = carried[READ] + bundle_s[g]
        least_finish = np.maximum(finish, read + next_release[_trailing_ones(after[BY_RELEASE])]) + work_left
        finished = (finish >= all_read) | (size == m - 1)  # saturated, or nothing left to add
        if finished.any():
            value = np.where(finished, finish if size == m - 1 else finish + work_left, np.inf)
            i = int(np.argmin(value))  # the first of equals: least predecessor, then least part
            if value[i] < best_value:
                best_value, best_finished = float(value[i]), (size, int(src[i]), int(g[i]))
        keep = np.flatnonzero((least_finish < best_value) & ~finished)
        # one entry per set: the least finish, ties to the least (predecessor, part); the
        # predecessors are in ascending set order, so this is the least predecessor set
        T = after[SET, keep]
        order = keep[np.lexsort((finish[keep], T))]  # (stable: ties stay in (predecessor, part) order)
        T_sorted = after[SET, order]
        first = order[np.concatenate(([True], T_sorted[1:] != T_sorted[:-1]))] if len(order) else order
        if beam is not None and len(first) > beam:  # the most promising, still in set order
            first = first[np.sort(np.argpartition(least_finish[first], beam)[:beam])]
        history.append((src[first], g[first]))
        masks = after[:, first]
        values = np.stack([finish[first], work[first], read[first]])
    if best_finished is None:
        return [], float("inf")
    size, i, last = best_finished
    prefix = [last]
    for src, g in reversed(history[:size]):
        prefix.append(int(g[i]))
        i = int(src[i])
    prefix.reverse()
    placed = set(prefix)
    return prefix + [x for x in range(m) if x not in placed], best_value
