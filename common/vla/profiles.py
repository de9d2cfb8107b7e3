"""Latency profiles: one table per (VLM arch, VLM batch, ADiT arch, ADiT batch, VLM share).

A profile is what the scheduler and the simulator know about a device:

* per architecture: the SLO, each stage's latency alone on the whole device per batch size, and
  the bytes the VLM hands to the ADiT stage (for inter-GPU baselines);
* per co-running pair (possibly of different architectures, for co-located models): for every
  candidate VLM share, the VLM time, ADiT time and lockstep time. The scheduler applies the
  share with the least lockstep time (Robion §4.1.2, "guarded dynamic spatial partitioning").

Profiles are JSON files (`format: orbitweaver.vla.profile/1`). The shipped ones in
`common/vla/profiles/` are derived from public numbers by `analytic.py`, with every assumption
listed in the file; `ow vla profile` measures the CPU backend into the same format.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PROFILE_FORMAT = "orbitweaver.vla.profile/1"
PROFILE_DIR = Path(__file__).with_name("profiles")
LOCKSTEP_COLUMNS = ("vlm_arch", "vlm_batch", "adit_arch", "adit_batch", "vlm_share", "vlm_ms", "adit_ms", "lockstep_ms")


@dataclass(frozen=True)
class ArchProfile:
    arch: str
    slo_ms: float
    vlm_ms: dict[int, float]  # batch -> ms, alone on the whole device
    adit_ms: dict[int, float]
    handoff_bytes: int = 0  # VLM -> ADiT state per request (prefix KV)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LockstepEntry:
    vlm_arch: str | None
    vlm_batch: int
    adit_arch: str | None
    adit_batch: int
    vlm_share: float
    vlm_ms: float
    adit_ms: float
    lockstep_ms: float


@dataclass
class ProfileTable:
    name: str
    backend: str  # "analytic-gpu" (derived from public numbers) or "cpu" (measured here)
    device: dict
    batch_sizes: tuple[int, ...]
    vlm_shares: tuple[float, ...]
    archs: dict[str, ArchProfile]
    locksteps: list[LockstepEntry]
    assumptions: list[str] = field(default_factory=list)
    calibration: list[dict] = field(default_factory=list)
    # measured tables: what measured them, when, how (docs/vla.md, "Measured lockstep tables")
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pairs: dict[tuple, list[LockstepEntry]] = {}
        for e in self.locksteps:
            self._pairs.setdefault((e.vlm_arch, e.vlm_batch, e.adit_arch, e.adit_batch), []).append(e)
        self._best = {k: min(v, key=lambda e: (e.lockstep_ms, -e.vlm_share)) for k, v in self._pairs.items()}

    # ---- lookups ----
    def arch(self, arch: str) -> ArchProfile:
        try:
            return self.archs[arch]
        except KeyError:
            raise KeyError(
                f"profile {self.name!r} has no architecture {arch!r} (has {', '.join(self.archs)})"
            ) from None

    def _batch(self, table: dict[int, float], batch: int, what: str) -> float:
        try:
            return table[batch]
        except KeyError:
            raise KeyError(
                f"profile {self.name!r} has no {what} time for batch {batch} (sizes {self.batch_sizes})"
            ) from None

    def vlm_alone(self, arch: str, batch: int) -> float:
        return self._batch(self.arch(arch).vlm_ms, batch, f"{arch} VLM")

    def adit_alone(self, arch: str, batch: int) -> float:
        return self._batch(self.arch(arch).adit_ms, batch, f"{arch} ADiT")

    def slo_ms(self, arch: str) -> float:
        return self.arch(arch).slo_ms

    def lockstep(
        self, vlm_arch: str | None, vlm_batch: int, adit_arch: str | None, adit_batch: int, share: float | None = None
    ) -> LockstepEntry:
        """The entry for a co-running pair: the best share, or the profiled share nearest `share`.

        A lockstep with only one stage runs it alone on the whole device.
        """
        if vlm_arch is None and adit_arch is None:
            raise ValueError("a lockstep runs at least one stage")
        if adit_arch is None:
            assert vlm_arch is not None  # checked above: at least one stage
            t = self.vlm_alone(vlm_arch, vlm_batch)
            return LockstepEntry(vlm_arch, vlm_batch, None, 0, 1.0, t, 0.0, t)
        if vlm_arch is None:
            t = self.adit_alone(adit_arch, adit_batch)
            return LockstepEntry(None, 0, adit_arch, adit_batch, 0.0, 0.0, t, t)
        key = (vlm_arch, vlm_batch, adit_arch, adit_batch)
        if key not in self._pairs:
            raise KeyError(f"profile {self.name!r} has no lockstep entry for {key}")
        if share is None:
            return self._best[key]
        return min(self._pairs[key], key=lambda e: abs(e.vlm_share - share))

    def with_slo(self, slo_ms: dict[str, float]) -> ProfileTable:
        """A copy with some architectures' SLOs replaced (experiments that vary deadlines)."""
        archs = dict(self.archs)
        for a, ms in slo_ms.items():
            p = self.arch(a)
            archs[a] = ArchProfile(p.arch, float(ms), p.vlm_ms, p.adit_ms, p.handoff_bytes, p.notes)
        return ProfileTable(
            self.name,
            self.backend,
            self.device,
            self.batch_sizes,
            self.vlm_shares,
            archs,
            self.locksteps,
            self.assumptions,
            self.calibration,
            self.provenance,
        )

    # ---- files ----
    def to_json(self) -> dict:
        out = {
            "format": PROFILE_FORMAT,
            "name": self.name,
            "backend": self.backend,
            "device": self.device,
            "assumptions": self.assumptions,
            "calibration": self.calibration,
            "batch_sizes": list(self.batch_sizes),
            "vlm_shares": list(self.vlm_shares),
            "archs": {
                a.arch: {
                    "slo_ms": round(a.slo_ms, 3),
                    "vlm_ms": {str(b): round(t, 4) for b, t in sorted(a.vlm_ms.items())},
                    "adit_ms": {str(b): round(t, 4) for b, t in sorted(a.adit_ms.items())},
                    "handoff_bytes": a.handoff_bytes,
                    "notes": list(a.notes),
                }
                for a in self.archs.values()
            },
            "lockstep_columns": list(LOCKSTEP_COLUMNS),
            "locksteps": [
                [
                    e.vlm_arch,
                    e.vlm_batch,
                    e.adit_arch,
                    e.adit_batch,
                    round(e.vlm_share, 4),
                    round(e.vlm_ms, 4),
                    round(e.adit_ms, 4),
                    round(e.lockstep_ms, 4),
                ]
                for e in self.locksteps
            ],
        }
        if self.provenance:
            out["provenance"] = self.provenance
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict) -> ProfileTable:
        validate_profile(data)
        archs = {
            name: ArchProfile(
                name,
                float(a["slo_ms"]),
                {int(b): float(t) for b, t in a["vlm_ms"].items()},
                {int(b): float(t) for b, t in a["adit_ms"].items()},
                int(a.get("handoff_bytes", 0)),
                tuple(a.get("notes", ())),
            )
            for name, a in data["archs"].items()
        }
        entries = [
            LockstepEntry(r[0], int(r[1]), r[2], int(r[3]), float(r[4]), float(r[5]), float(r[6]), float(r[7]))
            for r in data["locksteps"]
        ]
        return cls(
            data["name"],
            data["backend"],
            data.get("device", {}),
            tuple(int(b) for b in data["batch_sizes"]),
            tuple(float(s) for s in data["vlm_shares"]),
            archs,
            entries,
            list(data.get("assumptions", [])),
            list(data.get("calibration", [])),
            dict(data.get("provenance") or {}),
        )


BACKENDS = ("analytic-gpu", "cpu", "cuda")
MEASURED_BACKENDS = ("cpu", "cuda")
PROVENANCE_KEYS = ("tool", "measured_at", "git_commit", "statistic", "repeats", "dtype", "models", "slo")


def _positive(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number > 0, not {value!r}")
    return float(value)


def validate_profile(data) -> None:
    """Check a profile file's content against its format (docs/vla.md, "Profiles" and "Measured
    lockstep tables"); raise ValueError naming the first fault. Every pair of the table's
    architectures and batch sizes needs a lockstep row: a co-located GPU may run any of them, and
    a missing one would otherwise surface as a KeyError deep in a simulation."""
    if not isinstance(data, dict):
        raise ValueError(f"not a VLA profile (a JSON object is expected, not {type(data).__name__})")
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"not a VLA profile (format {data.get('format')!r}, expected {PROFILE_FORMAT!r})")
    missing = [k for k in ("name", "backend", "batch_sizes", "vlm_shares", "archs", "locksteps") if k not in data]
    if missing:
        raise ValueError(f"profile lacks {', '.join(missing)}")
    if data["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {data['backend']!r}")
    if not isinstance(data.get("device", {}), dict):
        raise ValueError("device must be an object")
    if data["backend"] in MEASURED_BACKENDS:
        prov = data.get("provenance")
        if not isinstance(prov, dict):
            raise ValueError(f"a measured table ({data['backend']}) needs its provenance (docs/vla.md)")
        lacking = [k for k in PROVENANCE_KEYS if k not in prov]
        if lacking:
            raise ValueError(f"provenance lacks {', '.join(lacking)}")
    cols = data.get("lockstep_columns", list(LOCKSTEP_COLUMNS))
    if list(cols) != list(LOCKSTEP_COLUMNS):
        raise ValueError(f"unexpected lockstep columns {cols}")
    sizes, shares = data["batch_sizes"], data["vlm_shares"]
    if (
        not isinstance(sizes, list)
        or not sizes
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)
    ):
        raise ValueError(f"batch_sizes must be a list of positive integers, not {sizes!r}")
    if not isinstance(shares, list) or not shares:
        raise ValueError(f"vlm_shares must be a non-empty list, not {shares!r}")
    for x in shares:
        if _positive(x, "a VLM share") >= 1.0:
            raise ValueError(f"a VLM share must be in (0, 1), not {x!r}")
    archs = data["archs"]
    if not isinstance(archs, dict) or not archs:
        raise ValueError("archs must be a non-empty object")
    for a, prof in archs.items():
        if not isinstance(prof, dict):
            raise ValueError(f"archs.{a} must be an object")
        _positive(prof.get("slo_ms"), f"archs.{a}.slo_ms")
        for stage in ("vlm_ms", "adit_ms"):
            table = prof.get(stage)
            if not isinstance(table, dict):
                raise ValueError(f"archs.{a}.{stage} must be an object of batch -> ms")
            for b in sizes:
                _positive(table.get(str(b), table.get(b)), f"archs.{a}.{stage}[{b}]")
    rows = data["locksteps"]
    if not isinstance(rows, list):
        raise ValueError("locksteps must be a list of rows")
    seen = set()
    for i, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != len(LOCKSTEP_COLUMNS):
            raise ValueError(f"locksteps[{i}] must be a row of {len(LOCKSTEP_COLUMNS)} values, not {r!r}")
        va, bv, aa, ba, share = r[:5]
        if va not in archs or aa not in archs:
            raise ValueError(f"locksteps[{i}]: architecture not in archs: {r!r}")
        if bv not in sizes or ba not in sizes:
            raise ValueError(f"locksteps[{i}]: batch size not in batch_sizes {sizes}: {r!r}")
        # rows keep shares to 4 decimals (to_json), the list in full (a third of the threads)
        if not any(isinstance(share, (int, float)) and abs(share - x) < 1e-3 for x in shares):
            raise ValueError(f"locksteps[{i}]: share {share!r} not in vlm_shares {shares}")
        for col, v in zip(LOCKSTEP_COLUMNS[5:], r[5:], strict=True):
            _positive(v, f"locksteps[{i}].{col}")
        seen.add((va, bv, aa, ba))
    for va, bv, aa, ba in itertools.product(archs, sizes, archs, sizes):
        if (va, bv, aa, ba) not in seen:
            raise ValueError(f"no lockstep row for VLM {va} batch {bv} beside ADiT {aa} batch {ba}")


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


@lru_cache(maxsize=16)
def _load_cached(path: str, mtime: float) -> ProfileTable:
    try:
        return ProfileTable.from_json(json.loads(Path(path).read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_profile(name_or_path: str | Path) -> ProfileTable:
    """Load a shipped profile by name (e.g. 'rtx-pro-6000x4') or any profile file by path."""
    p = Path(name_or_path)
    if not p.suffix and not p.exists():
        p = PROFILE_DIR / f"{name_or_path}.json"
    if not p.exists():
        raise FileNotFoundError(f"no profile {str(name_or_path)!r} (shipped: {', '.join(shipped_profiles())})")
    return _load_cached(str(p.resolve()), p.stat().st_mtime)


DEFAULT_PROFILE = "rtx-pro-6000x4"
