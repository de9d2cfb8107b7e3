"""Pace emulation: each unit of work takes at least a given wall time (demo and testbench).

A unit is one vision block, one decoder layer on one prefill chunk (a block of G layers counts
G), or one decode step, so policies with other block shapes take the same emulated compute time.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from flight.recovery.cost import BlockCosts

#: Pace units (decoder layers on one chunk) charged for rebuilding one layer's KV from its input
#: hidden state. The re-projection runs the layer's input norm and its Q, K and V projections:
#: about 3 of the attention's ~12 GEMM-equivalents per token, so a quarter of a layer. Pace
#: emulation only; the planner's estimate of the same work is `REPROJECT_COST_SHARE` in
#: flight/recovery/cost.py (docs/recovery.md, "Two re-projection shares").
REPROJECT_PACE_UNITS = 0.25


class Pacer:
    """Stretches each unit of work to at least `ms_per_unit` milliseconds (0: no pacing)."""

    def __init__(self, ms_per_unit: float):
        self.seconds_per_unit = ms_per_unit / 1000.0
        self.unit_started = time.perf_counter()

    def begin(self) -> None:
        self.unit_started = time.perf_counter()

    def end(self, units: float = 1.0) -> None:
        if self.seconds_per_unit > 0:
            left = self.seconds_per_unit * units - (time.perf_counter() - self.unit_started)
            if left > 0:
                time.sleep(left)


def paced_block_costs(costs: BlockCosts, groups: list[tuple[int, int]], seconds_per_unit: float) -> BlockCosts:
    """The prefill grid's costs as a paced payload spends them, for its recovery planner: each
    block and re-projection lasts at least what `Pacer` stretches it to (the pace is the
    testbench's stand-in for the target's compute), and at least `costs`' own estimate of the
    work (a machine slower than the pace is slower still). Reads are `costs`' own: the caller
    gives them at the emulated storage's rate.

    Without this a paced payload would plan with whatever calibration of this machine happens to
    be cached -- compute hundreds of times cheaper than the pace -- so its plans, and its progress
    in short windows, would depend on the cache and not on the target it emulates."""
    layers = np.array([end - first for first, end in groups], dtype=np.float64)[:, None]
    paced = np.broadcast_to(layers * seconds_per_unit, costs.compute.shape)
    assert costs.reproject is not None  # BlockCosts fills it in
    return replace(
        costs,
        compute=np.maximum(costs.compute, paced),
        reproject=np.maximum(costs.reproject, paced * REPROJECT_PACE_UNITS),
        source=f"paced {seconds_per_unit * 1000:g} ms/unit, reads {costs.source}",
    )
