"""Engine options: plain data, importable without torch (the onboard process parses them on its
main thread while the engine's libraries load in the background)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checkpoint.policies import Geometry, adaptive_policies, takes_adaptive_cadence

#: The payload's storage reserve unless `ow flight run --storage-reserve-mb` says otherwise
#: (flight/runtime/storage.py): many times the largest record the payload writes for itself (a
#: finished task's result, ~40 KiB; a journal entry, ~17 KiB), a rounding error on a flight
#: computer's data disk. Here, not there, so that parsing the command line imports no wire code.
DEFAULT_RESERVE_BYTES = 8 << 20

#: The recovery planner a payload flies unless told otherwise: OrbitWeaver's own (docs/recovery.md),
#: which is never worse than either fixed order under its cost model. The paper-defined baselines
#: restore with the scheduler their definitions give whatever is asked (Policy.recovery); the
#: strengthened ones (`+`) fly this one too. Imported by the engine only when it plans (it brings
#: numpy), never on the path that answers the bus.
DEFAULT_PLANNER = "optimal"

#: The names `--planner` accepts: those flight/recovery registers (plan.PLANNERS once the package is
#: imported; a test keeps the two equal). Named here so that checking a command line imports no
#: planner: the planner and numpy load on the inference worker, off the thread that answers the bus.
PLANNER_NAMES = ("chunk-first", "layer-first", "optimal")


@dataclass
class EngineOptions:
    geometry: Geometry = field(default_factory=Geometry)
    policy: str = "orbitweaver"
    planner: str = DEFAULT_PLANNER
    overlap_recovery: bool = True
    async_writes: bool = True
    pace_ms: float = 0.0  # minimum wall time per block / step (emulates a slower payload)
    threads: int | None = None  # intra-op threads; pinned in the MANIFEST
    # "int8": decode records hold KV quantised per channel (about half the bytes in bf16, a
    # quarter in fp32, so faster decode-phase recovery) -- the one option that gives up bitwise
    # identity after a resume in decode. Off by default.
    decode_kv_compression: str = "none"
    # "fixed": the policy's cadence (a decode record every D steps, a vision state every k
    # blocks); "adaptive": also early records when a cut is likely before the next one
    # (flight/checkpoint/cadence.py). Only orbitweaver adapts: the baselines keep the cadence
    # their definitions give. None: the policy's default (`default_cadence`), resolved where the
    # policy is known (the engine, the onboard process), so that an options object handed on to
    # another policy never carries one policy's default to the other. Not in the MANIFEST:
    # records are the same either way.
    cadence: str | None = None

    def __post_init__(self) -> None:
        # Refused here, not only on the command lines: an engine given a baseline with the
        # adaptive cadence would otherwise fly the fixed one and say nothing.
        if self.cadence not in (None, *CADENCES):
            raise ValueError(f"unknown cadence {self.cadence!r} (one of {', '.join(CADENCES)})")
        if self.cadence == "adaptive" and not takes_adaptive_cadence(self.policy):
            raise ValueError(
                f"the adaptive cadence is {'/'.join(adaptive_policies())}'s; the {self.policy} baseline keeps the "
                "cadence its definition gives (docs/baselines.md)"
            )


CADENCES = ("fixed", "adaptive")


def default_cadence(policy: str) -> str:
    """The checkpoint cadence a run that names none gets: "adaptive" for orbitweaver (it finishes
    the most requests in the testbench campaigns, docs/engine.md "Cadence"), "fixed" for every
    other policy (a baseline's cadence is part of its definition, docs/baselines.md). The one
    place this default is decided: the command lines, the engine, the onboard process and the
    testbench all ask here."""
    return "adaptive" if takes_adaptive_cadence(policy) else "fixed"


def resolve_cadence(policy: str, cadence: str | None) -> str:
    """The cadence a run of `policy` flies: the one it names, else the policy's default."""
    return default_cadence(policy) if cadence is None else cadence
