"""Measure a latency profile on the CPU backend (`ow vla profile`).

Runs the real models through the real `CpuLockstepBackend`: every stage alone on all threads,
and every co-running (VLM arch, VLM batch, ADiT arch, ADiT batch) pair under every thread split
(the CPU's "VLM share"). Writes the same table format as the shipped GPU profiles, so the
scheduler and the simulator take either.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

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


def git_commit() -> str | None:
    """The measuring tree's commit (provenance), or None outside a checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def measure_profile(
    backend,
    device: str = "cpu",
    archs: Iterable[str] = ("pi0", "smolvla"),
    dtype: torch.dtype = torch.float32,
    batch_sizes: tuple[int, ...] = (1, 2, 4),
    shares: tuple[float, ...] = (0.5,),
    repeats: int = 3,
    slo_factor: float = DEFAULT_SLO_FACTOR,
    network_rtt_ms: float = 0.0,
    name: str = "measured",
    device_info: dict | None = None,
    tool: str = "ow vla profile",
    progress: Callable[[str], None] | None = None,
) -> ProfileTable:
    """A measured lockstep table (docs/vla.md, "Measured lockstep tables") of the real models on
    `backend` (a CPU or CUDA lockstep backend, which the caller closes): every stage alone on the
    whole device, and every (VLM arch, VLM batch, ADiT arch, ADiT batch) pair -- cross-model ones
    too -- co-running under every VLM share; each cell the median of `repeats` runs after one
    warm-up. SLO = slo_factor x (batch-1 VLM + ADiT alone + network_rtt_ms)."""
    policies = {a: VlaPolicy(ModelSpec(a, a), device=device, dtype=dtype) for a in archs}
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

    arch_profiles = {}
    for a, pol in policies.items():
        vlm = {b: timed(LockstepPlan(0, _batch(Stage.VLM, pol, vlm_pool[a][:b]), None, 1.0))[2] for b in batch_sizes}
        adit = {b: timed(LockstepPlan(0, None, _batch(Stage.ADIT, pol, adit_pool[a][:b]), 0.0))[2] for b in batch_sizes}
        slo = slo_factor * (vlm[batch_sizes[0]] + adit[batch_sizes[0]] + network_rtt_ms)
        arch_profiles[a] = ArchProfile(a, slo, vlm, adit, 0, (f"measured on the {backend.name} backend",))
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
    # slo_factor: what `ow vla bench --slo-factors` scales the SLOs from (bench.base_slo_factor)
    device_doc = {"count": 1, "torch": torch.__version__, "slo_factor": slo_factor, **(device_info or {})}
    rtt = f" + {network_rtt_ms:g} ms network round trip" if network_rtt_ms else ""
    provenance = {
        "tool": tool,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": git_commit(),
        "statistic": "median",
        "repeats": repeats,
        "warmup": 1,
        "dtype": str(dtype).removeprefix("torch."),
        "models": "the tiny random-weight models of common/vla/config.py at their public shapes (not real widths)",
        "slo": f"{slo_factor:g} x (batch-{batch_sizes[0]} VLM + ADiT alone{rtt}): no on-robot reference measured",
    }
    assumptions = [
        f"Measured on the {backend.name} backend; each time the median of {repeats} runs after one warm-up.",
        f"SLO = {slo_factor:g} x (batch-{batch_sizes[0]} VLM + ADiT alone{rtt}): no on-robot reference.",
    ]
    return ProfileTable(
        name,
        backend.name,
        device_doc,
        tuple(batch_sizes),
        tuple(shares),
        arch_profiles,
        entries,
        assumptions,
        provenance=provenance,
    )


def measure_cpu_profile(
    archs: Iterable[str] = ("pi0", "smolvla"),
    batch_sizes: tuple[int, ...] = (1, 2, 4),
    threads: int | None = None,
    repeats: int = 3,
    slo_factor: float = DEFAULT_SLO_FACTOR,
    name: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> ProfileTable:
    """The CPU backend's table: the VLM share is the VLM thread's share of the threads."""
    backend = CpuLockstepBackend(threads)
    total = backend.total_threads
    shares = tuple(v / total for v in range(1, total)) if total > 1 else (0.5,)
    try:
        prof = measure_profile(
            backend,
            "cpu",
            archs,
            torch.float32,
            batch_sizes,
            shares,
            repeats,
            slo_factor,
            name=name,
            device_info={"name": "CPU", "threads": total},
            progress=progress,
        )
    finally:
        backend.close()
    prof.assumptions.insert(1, f"VLM share = VLM intra-op threads / {total}; the ADiT thread gets the rest.")
    return prof


def _fmt(times: dict[int, float]) -> str:
    return "{" + ", ".join(f"{b}: {t:.1f}" for b, t in times.items()) + "}"
