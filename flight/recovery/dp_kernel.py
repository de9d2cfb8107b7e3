"""The optimal planner's subset DP as a compiled loop (numba; docs/recovery.md §4).

    finish[S | g] = min over the last part g of max(finish[S] + P[g, b, a], read[S] + h[g, b, a])

Sets are visited in increasing integer order, which is topological (S | g > S). For each
reachable set S, each missing part g is appended; the run [a, b] of consecutive parts around g
in S | g comes from S's bits. `work[S]` (the job time released by S: the sum of P along any
order of S, so a function of S alone) gives the pruning rule: a set with
finish[S] + (all work - work[S]) >= bound leads to no order that finishes the jobs before the
bound, and is not extended. About 2-3 ns per transition: 18 parts (2^18 sets x 18) take a few
milliseconds, where the numpy version takes ~40 ms.

Compiled on first use and cached on disk (numba's cache, next to this file or in
NUMBA_CACHE_DIR), so a payload pays the compilation once, not at every boot.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros


@numba.njit(cache=True, nogil=True)
def subset_dp(m, P, h, bundle_s, bound):  # pragma: no cover - compiled; tested through optimal.solve
    n = 1 << m
    full = n - 1
    finish = np.full(n, np.inf)
    work = np.zeros(n)
    read = np.zeros(n)
    last = np.full(n, -1, dtype=np.int8)
    finish[0] = 0.0
    total = 0.0  # all the work: what reading the parts in the order 0..m-1 releases
    for g in range(m):
        total += P[(g * m + g) * m]  # part g after parts 0..g-1: its run is [0, g]
    for S in range(1, n):
        low = S & -S
        read[S] = read[S ^ low] + bundle_s[trailing_zeros(np.int64(low))]
    for S in range(n):
        f = finish[S]
        if f == np.inf:
            continue
        w = work[S]
        if f + (total - w) >= bound:
            continue
        r = read[S]
        missing = full & ~S
        while missing:
            bit = missing & -missing
            missing ^= bit
            g = trailing_zeros(np.int64(bit))
            # the run of S's bits just above g ends at b; the run just below starts at a
            b = g + trailing_zeros(np.int64(~(S >> (g + 1))))
            if b > m - 1:
                b = m - 1
            below = (S << (64 - g)) if g > 0 else np.int64(0)
            a = g - leading_zeros(np.int64(~below)) if g > 0 else 0
            idx = (g * m + b) * m + a
            T = S | bit
            work[T] = w + P[idx]
            cand = f + P[idx]
            alt = r + h[idx]
            if alt > cand:
                cand = alt
            if cand < finish[T]:
                finish[T] = cand
                last[T] = g
    return finish, last
