"""Engine options: plain data, importable without torch (the onboard process parses them on its
main thread while the engine's libraries load in the background)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checkpoint.policies import Geometry


@dataclass
class EngineOptions:
    geometry: Geometry = field(default_factory=Geometry)
    policy: str = "orbitweaver"
    planner: str = "chunk-first"
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
    # their definitions give. Not in the MANIFEST: records are the same either way.
    cadence: str = "fixed"
