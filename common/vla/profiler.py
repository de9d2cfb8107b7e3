"""Measure a latency profile on the CPU backend (`ow vla profile`).

Runs the real models through the real `CpuLockstepBackend`: every stage alone on all threads,
and every co-running (VLM arch, VLM batch, ADiT arch, ADiT batch) pair under every thread split
(the CPU's "VLM share"). Writes the same table format as the shipped GPU profiles, so the
scheduler and the simulator take either.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

from common.vla.backend_cpu import CpuLockstepBackend
from common.vla.config import ModelSpec
from common.vla.models import VlaPolicy, example_observation
from common.vla.profiles import ArchProfile, LockstepEntry, ProfileTable
from common.vla.scheduler import LockstepPlan, Stage, StageBatch, VlaRequest

DEFAULT_SLO_FACTOR = 3.0  # SLO of a measured CPU profile: 3x the batch-1 VLM + ADiT time


def _requests(policy: VlaPolicy, n: int, first_seed: int = 0) -> list[VlaRequest]:
    """n requests with inputs and their VLM prefix (so that any of them can go to an ADiT batch)."""
    reqs = [
        VlaRequest(policy.spec.name, 0.0, 0.0, 1.0, payload=policy.prepare(example_observation(first_seed + i)))
        for i in range(n)
    ]
    for r, p in zip(reqs, policy.run_vlm([r.payload for r in reqs], n), strict=True):
        r.prefix = p
    return reqs


def _batch(stage: Stage, policy: VlaPolicy, reqs: list[VlaRequest]) -> StageBatch:
    return StageBatch(stage, policy.spec.name, policy.spec.arch, tuple(reqs), len(reqs))


def measure_cpu_profile(
    archs: Iterable[str] = ("pi0", "smolvla"),
    batch_sizes: tuple[int, ...] = (1, 2, 4),
    threads: int | None = None,
    repeats: int = 3,
    slo_factor: float = DEFAULT_SLO_FACTOR,
    name: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> ProfileTable:
    backend = CpuLockstepBackend(threads)
    total = backend.total_threads
    shares = tuple(v / total for v in range(1, total)) if total > 1 else (0.5,)
    policies = {a: VlaPolicy(ModelSpec(a, a)) for a in archs}
    by_name = {p.spec.name: p for p in policies.values()}
    top = max(batch_sizes)
    # Disjoint request pools for the VLM and the ADiT side of a lockstep, as in real serving.
    vlm_pool = {a: _requests(p, top) for a, p in policies.items()}
    adit_pool = {a: _requests(p, top, first_seed=top) for a, p in policies.items()}
    saved = {r.request_id: r.prefix for pool in adit_pool.values() for r in pool}

    def timed(plan: LockstepPlan) -> tuple[float, float, float]:
        runs = []
        for i in range(repeats + 1):  # the first run warms up
            if plan.adit:  # the ADiT batch consumes its prefixes; give them back for the next run
                for r in plan.adit.requests:
                    r.prefix = saved[r.request_id]
            t = backend.run(plan, by_name)
            if i:
                runs.append(t)
        return (
            statistics.median(r.vlm_ms for r in runs),
            statistics.median(r.adit_ms for r in runs),
            statistics.median(r.wall_ms for r in runs),
        )

    try:
        arch_profiles = {}
        for a, pol in policies.items():
            vlm = {
                b: timed(LockstepPlan(0, _batch(Stage.VLM, pol, vlm_pool[a][:b]), None, 1.0))[2] for b in batch_sizes
            }
            adit = {
                b: timed(LockstepPlan(0, None, _batch(Stage.ADIT, pol, adit_pool[a][:b]), 0.0))[2] for b in batch_sizes
            }
            slo = slo_factor * (vlm[batch_sizes[0]] + adit[batch_sizes[0]])
            arch_profiles[a] = ArchProfile(a, slo, vlm, adit, 0, (f"measured on CPU, {total} threads",))
            if progress:
                progress(f"{a}: VLM {_fmt(vlm)} ADiT {_fmt(adit)} ms, SLO {slo:.1f} ms")
        entries = []
        for va, vp in policies.items():
            for bv in batch_sizes:
                for aa, ap in policies.items():
                    for ba in batch_sizes:
                        for share in shares:
                            plan = LockstepPlan(
                                0,
                                _batch(Stage.VLM, vp, vlm_pool[va][:bv]),
                                _batch(Stage.ADIT, ap, adit_pool[aa][:ba]),
                                share,
                            )
                            entries.append(LockstepEntry(va, bv, aa, ba, share, *timed(plan)))
        device = {
            "name": "CPU",
            "count": 1,
            "threads": total,
            "torch": torch.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        assumptions = [
            "Measured on the CPU backend: tiny random models, float32, two executor threads.",
            f"VLM share = VLM intra-op threads / {total}; the ADiT thread gets the rest.",
            f"Each time is the median of {repeats} runs after one warm-up run.",
            f"SLO = {slo_factor} x (batch-{batch_sizes[0]} VLM + ADiT alone): a CPU has no on-robot reference.",
        ]
        return ProfileTable(name, "cpu", device, tuple(batch_sizes), shares, arch_profiles, entries, assumptions)
    finally:
        backend.close()


def _fmt(times: dict[int, float]) -> str:
    return "{" + ", ".join(f"{b}: {t:.1f}" for b, t in times.items()) + "}"
