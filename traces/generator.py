"""Physical interruption-trace generator.

The structure follows the OEC simulator (Denby & Lucia, "Orbital Edge Computing: Nanosatellite
Constellation Design and Deployment", ASPLOS'20; github.com/CMUAbstract/oec-asplos20-artifact,
`software/satsim`): an orbit advanced in fixed steps, an energy-harvesting system made of a
harvester (`SimpleSolarCell`: a constant current source while the node voltage is below its
maximum-power voltage), an energy store and energy consumers, with the node voltage solved from

    V = V_store + R·(I_harvest − P_load / V)   ⇒   V = (a + sqrt(a² − 4·R·P_load)) / 2,
    a = V_store + R·I_harvest                       (OEC `EHSystem::calculateNodeVoltage`)

and consumers that switch themselves off below one voltage and back on above a higher one
(OEC `JetsonTX2::update`: off below 5.5 V, back on at 6.75 V). What differs from OEC, and why:

- Eclipses. OEC's harvester never goes dark; a LEO satellite spends about a third of each orbit in
  Earth's shadow, which is what makes the payload power-bound. `Orbit` computes period and eclipse
  length from altitude and beta angle.
- Storage. OEC stores energy in a supercapacitor (V = Q/C). The satellites this product targets run
  a Li-ion battery bus, so the store is a 4-cell battery whose open-circuit voltage follows the
  BUPT-1 pack's measured discharge curve (`BUPT1_PACK_OCV`), with a series resistance.
- Thresholds on state of charge. Brown-out protection switches the payload off at `soc_off` and
  back on at `soc_on` (hysteresis, as OEC's 5.5 V / 6.75 V pair), plus an under-voltage lockout.
- Thermal, FDIR and contention, which OEC does not model: a first-order payload thermal model
  anchored on the paper's Sat-1 report (45 → 55 °C in 48 s under inference load), FDIR resets as a
  Poisson process, and scheduled higher-priority payload windows.

Time advances in 1 s steps (the telemetry rate). Events therefore fall on whole seconds. Every
random draw comes from `random.Random` seeded per stream (FDIR, contention) with a string derived
from the seed; `Random.random()` is the one stream the Python documentation promises to keep
reproducible across versions, and exponential variates are derived from it here rather than with
`expovariate`, so a seed gives byte-identical traces.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from traces.model import CutCause, Event, EventKind, TelemetrySample, Trace

EARTH_RADIUS_KM = 6378.137  # WGS-84 equatorial radius
EARTH_MU_KM3_S2 = 398600.4418  # Earth's gravitational parameter (standard value)

# BUPT-1 battery pack (4 Li-ion cells in series, 115 Wh as the dataset's authors normalize it):
# pack voltage vs energy drawn, read from the ground constant-current (0.97 A ≈ C/8) discharge
# test published with the BUPT-1 telemetry (MobiCom'24 dataset, TiansuanConstellation/
# MobiCom24-SatelliteCOTS, Energy-ShortTerm/battery_curve/discharging_df_1.csv; rows at 0, 12.0,
# 31.5, 50.4, 68.6, 86.3, 98.7, 106.8, 112.6 and 118.7 Wh; 115 Wh interpolated). State of charge is
# 1 − energy drawn / 115 Wh, the normalization of that repository's processing.py.
BUPT1_PACK_CAPACITY_WH = 115.0
BUPT1_PACK_OCV = (  # (state of charge, pack voltage in V), ascending in state of charge
    (0.0000, 12.364),
    (0.0211, 12.599),
    (0.0714, 13.199),
    (0.1415, 13.678),
    (0.2492, 14.060),
    (0.4035, 14.422),
    (0.5621, 14.886),
    (0.7258, 15.444),
    (0.8955, 15.985),
    (1.0000, 16.255),
)


def pack_voltage(soc: float, curve: tuple[tuple[float, float], ...] = BUPT1_PACK_OCV) -> float:
    """Open-circuit pack voltage at a state of charge (linear between measured points)."""
    soc = min(1.0, max(0.0, soc))
    socs = [s for s, _ in curve]
    index = bisect.bisect_right(socs, soc)
    if index <= 0:
        return curve[0][1]
    if index >= len(curve):
        return curve[-1][1]
    (s0, v0), (s1, v1) = curve[index - 1], curve[index]
    return v0 + (v1 - v0) * (soc - s0) / (s1 - s0)


def soc_from_voltage(voltage: float, curve: tuple[tuple[float, float], ...] = BUPT1_PACK_OCV) -> float:
    """Inverse of `pack_voltage` (the curve is monotonic); clamps to [0, 1]."""
    volts = [v for _, v in curve]
    if voltage <= volts[0]:
        return 0.0
    if voltage >= volts[-1]:
        return 1.0
    index = bisect.bisect_right(volts, voltage)
    (s0, v0), (s1, v1) = curve[index - 1], curve[index]
    return s0 + (s1 - s0) * (voltage - v0) / (v1 - v0)


# ------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class OrbitParams:
    """Circular LEO orbit. Period from Kepler's third law; eclipse from a cylindrical Earth shadow:
    eclipse fraction = arccos( sqrt(h² + 2·R·h) / ((R + h)·cos β) ) / π  (Wertz & Larson, Space
    Mission Analysis and Design, eq. for circular-orbit eclipse), zero when |β| is past the
    shadow's edge. Phase 0 is orbit sunrise: the trace starts at the beginning of daylight."""

    altitude_km: float = 520.0
    beta_deg: float = 0.0
    start_phase_s: float = 0.0

    @property
    def period_s(self) -> float:
        a = EARTH_RADIUS_KM + self.altitude_km
        return 2.0 * math.pi * math.sqrt(a**3 / EARTH_MU_KM3_S2)

    @property
    def eclipse_s(self) -> float:
        r, h = EARTH_RADIUS_KM, self.altitude_km
        beta = math.radians(self.beta_deg)
        if abs(beta) >= math.asin(r / (r + h)):
            return 0.0
        ratio = math.sqrt(h * h + 2.0 * r * h) / ((r + h) * math.cos(beta))
        return self.period_s * math.acos(ratio) / math.pi

    def sunlit(self, t_s: float) -> bool:
        phase = (t_s + self.start_phase_s) % self.period_s
        return phase < self.period_s - self.eclipse_s


@dataclass(frozen=True)
class PowerParams:
    """Solar array + battery + loads, and the bus's brown-out protection for the payload.
    Defaults are BUPT-1's measured values where the telemetry gives them (see presets.py)."""

    battery_capacity_wh: float = BUPT1_PACK_CAPACITY_WH
    battery_resistance_ohm: float = 0.1  # BUPT-1 bus steps 0.02-0.06 V for a 0.45 A load step
    solar_current_a: float = 1.34  # array current into the bus in sunlight; BUPT-1 sunlit mean
    platform_load_w: float = 11.0  # everything but the compute payload; BUPT-1, payloads off
    payload_load_w: float = 15.0  # compute payload under inference load (Jetson Orin NX 15 W)
    soc_off: float = 0.30  # payload switched off at or below this state of charge
    soc_on: float = 0.50  # ... and back on once charged to this (hysteresis)
    undervoltage_v: float = 13.2  # hard lockout (3.3 V per cell): unannounced cut below this
    soc_initial: float = 0.8  # at the start of the warm-up
    warning_lead_s: float = 0.0  # 0: brown-out cuts are not announced


def tau_for_heating(from_c: float, to_c: float, seconds: float, steady_c: float) -> float:
    """Time constant of a first-order body that heats from `from_c` to `to_c` in `seconds` while
    settling towards `steady_c`: τ = seconds / ln((steady − from) / (steady − to))."""
    if not steady_c > to_c > from_c:
        raise ValueError("need steady_c > to_c > from_c")
    return seconds / math.log((steady_c - from_c) / (steady_c - to_c))


# The paper's Sat-1 report (§2.2): inference heats the payload from 45 °C to the 55 °C enclosure
# threshold in 48 s. With the assumed loaded steady state of 75 °C at a 25 °C structure this gives
# τ = 48 / ln(30 / 20) = 118.4 s.
SAT1_HEAT_FROM_C, SAT1_HEAT_TO_C, SAT1_HEAT_TIME_S = 45.0, 55.0, 48.0
SAT1_LOADED_STEADY_C, SAT1_REFERENCE_ENV_C = 75.0, 25.0
SAT1_TAU_S = tau_for_heating(SAT1_HEAT_FROM_C, SAT1_HEAT_TO_C, SAT1_HEAT_TIME_S, SAT1_LOADED_STEADY_C)


@dataclass(frozen=True)
class ThermalParams:
    """First-order payload thermal model on top of a first-order structure (the payload's
    environment), both integrated exactly over each step:

        payload:   dT/dt = (T_struct + ΔT_load·[payload on] − T) / tau_s
        structure: dS/dt = (S_sun or S_eclipse − S) / structure_tau_s

    ΔT_load = loaded_steady_c − reference_env_c is how far above its environment the payload
    settles under inference load. The defaults are Sat-1's: τ from the 45 → 55 °C in 48 s report,
    which then holds exactly whenever the structure is at `reference_env_c`; a colder structure
    heats the payload more slowly and cools it faster.
    """

    limit_c: float = 55.0  # bus cuts the payload at this temperature (Sat-1 enclosure threshold)
    restart_c: float = 45.0  # ... and re-enables it once cooled to this
    loaded_steady_c: float = SAT1_LOADED_STEADY_C
    reference_env_c: float = SAT1_REFERENCE_ENV_C
    tau_s: float = SAT1_TAU_S
    structure_sun_c: float = 25.0  # structure settles here in permanent sunlight
    structure_eclipse_c: float = 25.0  # ... and here in permanent shadow
    structure_tau_s: float = 1800.0
    warning_lead_s: float = 0.0  # 0: thermal cuts are not announced

    @property
    def load_rise_c(self) -> float:
        return self.loaded_steady_c - self.reference_env_c


@dataclass(frozen=True)
class FdirParams:
    """FDIR resets of the payload: a Poisson process (rate per second of payload on-time; arrivals
    while the payload is off do nothing). The paper reports resets as often as once a minute in the
    worst case (rate 1/60)."""

    rate_per_s: float = 0.0
    off_s: float = 20.0  # power-cycle time before the bus re-enables the payload


@dataclass(frozen=True)
class ContentionParams:
    """Scheduled higher-priority payload windows (downlink passes, imaging) that take the power
    budget: `per_orbit` windows per orbit at uniformly random phases, lengths uniform in
    [min_s, max_s]. The schedule is known, so the bus can warn `warning_lead_s` ahead and does not
    switch the payload on when a window starts within that lead."""

    per_orbit: int = 0
    min_s: float = 120.0
    max_s: float = 480.0
    warning_lead_s: float = 0.0


@dataclass(frozen=True)
class SatelliteConfig:
    """Everything the generator needs for one kind of satellite."""

    kind: str
    description: str
    duration_s: int
    orbit: OrbitParams = field(default_factory=OrbitParams)
    power: PowerParams = field(default_factory=PowerParams)
    thermal: ThermalParams = field(default_factory=ThermalParams)
    fdir: FdirParams = field(default_factory=FdirParams)
    contention: ContentionParams = field(default_factory=ContentionParams)
    min_off_s: int = 5  # shortest off time the bus enforces after any cut
    warmup_s: int = 3 * 5700  # simulated before t=0 so state of charge and temperatures settle
    reference_request_s: float = 180.0
    assumptions: tuple[str, ...] = ()

    def parameters(self) -> dict[str, Any]:
        """All model numbers, for the trace header's `source`."""
        out = asdict(self)
        for key in ("kind", "description", "assumptions", "duration_s"):
            out.pop(key)
        out["orbit"]["derived_period_s"] = round(self.orbit.period_s, 1)
        out["orbit"]["derived_eclipse_s"] = round(self.orbit.eclipse_s, 1)
        return out


# ------------------------------------------------------------------------------------ simulation


@dataclass
class _Pending:
    t_s: int
    cause: CutCause
    lead_s: float
    warning_index: int | None  # index in the recorded events, None if warned before t=0


def _exponential(rng: random.Random, rate: float) -> float:
    # Inverse-CDF from Random.random() (reproducible across Python versions, unlike expovariate).
    return -math.log(1.0 - rng.random()) / rate


def _contention_windows(config: SatelliteConfig, seed: int, start_s: int, end_s: int) -> list[tuple[int, int]]:
    spec = config.contention
    if spec.per_orbit <= 0:
        return []
    rng = random.Random(f"orbitweaver-trace/{seed}/contention")
    period = config.orbit.period_s
    first_orbit = math.floor(start_s / period)
    last_orbit = math.ceil(end_s / period)
    windows = []
    for orbit in range(first_orbit, last_orbit + 1):
        for _ in range(spec.per_orbit):
            begin = round(orbit * period + rng.random() * period)
            length = round(spec.min_s + rng.random() * (spec.max_s - spec.min_s))
            windows.append((begin, begin + max(1, length)))
    windows.sort()
    merged: list[tuple[int, int]] = []
    for begin, end in windows:
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _node_voltage(open_circuit_v: float, resistance: float, harvest_a: float, load_w: float) -> float | None:
    """OEC EHSystem node voltage; None when no operating point exists (blackout)."""
    a = open_circuit_v + resistance * harvest_a
    discriminant = a * a - 4.0 * resistance * load_w
    if discriminant < 0.0:
        return None
    return 0.5 * (a + math.sqrt(discriminant))


def simulate(config: SatelliteConfig, seed: int, duration_s: int | None = None, *, name: str | None = None) -> Trace:
    """Run the model for `duration_s` seconds (default: the config's) after its warm-up and
    return the trace. Deterministic: the same config, seed and duration give an equal trace."""
    duration = int(config.duration_s if duration_s is None else duration_s)
    if duration <= 0:
        raise ValueError("duration_s must be > 0")
    orbit, pwr, th, fd = config.orbit, config.power, config.thermal, config.fdir
    start = -int(config.warmup_s)

    contention = _contention_windows(config, seed, start, duration + int(orbit.period_s))
    contention_starts = [b for b, _ in contention]
    fdir_rng = random.Random(f"orbitweaver-trace/{seed}/fdir")
    next_fdir = start + _exponential(fdir_rng, fd.rate_per_s) if fd.rate_per_s > 0 else math.inf

    tau = th.tau_s
    payload_decay = math.exp(-1.0 / tau)
    structure_decay = math.exp(-1.0 / th.structure_tau_s)

    soc = pwr.soc_initial
    structure_c = 0.5 * (th.structure_sun_c + th.structure_eclipse_c)
    payload_c = structure_c
    on = False
    pending: _Pending | None = None
    power_latched = False  # set by a brown-out cut, cleared at soc_on
    thermal_latched = False  # set by a thermal cut, cleared at restart_c
    fdir_until = -math.inf
    last_cut = -math.inf

    events: list[Event] = []
    telemetry: list[TelemetrySample] = []

    def contention_at(t: int) -> tuple[bool, int | None]:
        """Whether a contention window is active at t, and the next window start after t."""
        index = bisect.bisect_right(contention_starts, t)
        active = index > 0 and contention[index - 1][0] <= t < contention[index - 1][1]
        upcoming = contention_starts[index] if index < len(contention_starts) else None
        return active, upcoming

    def harvest_a(t: int) -> float:
        return pwr.solar_current_a if orbit.sunlit(t) else 0.0

    def bus_state(t: int, payload_on: bool) -> tuple[float | None, float]:
        """(bus voltage or None on blackout, battery current into the cells in A)."""
        load = pwr.platform_load_w + (pwr.payload_load_w if payload_on else 0.0)
        ocv = pack_voltage(soc)
        harvest = harvest_a(t)
        voltage = _node_voltage(ocv, pwr.battery_resistance_ohm, harvest, load)
        if voltage is None:
            return None, 0.0
        current = harvest - load / voltage
        if soc >= 1.0 and current > 0.0:
            # Full battery: the charge regulator shunts the surplus and holds the bus at the
            # pack's full-charge voltage.
            return pack_voltage(1.0), 0.0
        return voltage, current

    def soc_rate_per_s(t: int, payload_on: bool) -> float:
        _, current = bus_state(t, payload_on)
        return pack_voltage(soc) * current / (3600.0 * pwr.battery_capacity_wh)

    for t in range(start, duration + 1):
        recording = t >= 0
        step_events: list[Event] = []
        active_contention, next_contention = contention_at(t)
        was_on = on

        if on:
            voltage_now, _ = bus_state(t, True)
            cause: CutCause | None = None
            lead = 0.0
            if pending is not None and pending.t_s == t:
                cause, lead = pending.cause, pending.lead_s
            elif next_fdir <= t:
                cause = CutCause.FDIR
            elif active_contention:
                cause = CutCause.CONTENTION
            elif voltage_now is None or voltage_now < pwr.undervoltage_v:
                cause = CutCause.POWER
            elif pending is None and payload_c >= th.limit_c:
                cause = CutCause.THERMAL
            elif pending is None and soc <= pwr.soc_off:
                cause = CutCause.POWER
            if cause is not None:
                if pending is not None and lead == 0.0 and pending.warning_index is not None and recording:
                    # An unannounced cut overtook an announced one: the format has no superseded
                    # warnings, so the overtaken warning is not part of the trace.
                    events.pop(pending.warning_index)
                step_events.append(Event(float(t), EventKind.CUT, cause, lead))
                on, pending, last_cut = False, None, t
                if cause is CutCause.FDIR:
                    fdir_until = t + fd.off_s
                elif cause is CutCause.POWER:
                    power_latched = True
                elif cause is CutCause.THERMAL:
                    thermal_latched = True
        # FDIR arrivals while the payload is off (or that just caused a cut) are used up.
        while next_fdir <= t:
            next_fdir += _exponential(fdir_rng, fd.rate_per_s)

        if not on:
            if power_latched and soc >= pwr.soc_on:
                power_latched = False
            if thermal_latched and payload_c <= th.restart_c:
                thermal_latched = False
            holdoff = (
                config.contention.warning_lead_s > 0
                and next_contention is not None
                and next_contention - t <= config.contention.warning_lead_s
            )
            voltage_on, _ = bus_state(t, True)
            may_start = (
                t >= fdir_until
                and t - last_cut >= config.min_off_s
                and not active_contention
                and not holdoff
                and not power_latched
                and not thermal_latched
                and soc > pwr.soc_off
                and payload_c < th.limit_c
                and voltage_on is not None
                and voltage_on >= pwr.undervoltage_v
            )
            if may_start:
                on = True
                step_events.append(Event(float(t), EventKind.POWER_ON))

        if on and pending is None:
            # The bus announces a cut it can foresee and then holds to the announced time.
            warn: tuple[CutCause, float] | None = None
            if th.warning_lead_s > 0:
                target = structure_c + th.load_rise_c
                predicted = target + (payload_c - target) * math.exp(-th.warning_lead_s / tau)
                if predicted >= th.limit_c:
                    warn = (CutCause.THERMAL, th.warning_lead_s)
            if warn is None and pwr.warning_lead_s > 0:
                if soc + soc_rate_per_s(t, True) * pwr.warning_lead_s <= pwr.soc_off:
                    warn = (CutCause.POWER, pwr.warning_lead_s)
            if (
                warn is None
                and config.contention.warning_lead_s > 0
                and next_contention is not None
                and 0 < next_contention - t <= config.contention.warning_lead_s
            ):
                warn = (CutCause.CONTENTION, float(next_contention - t))
            if warn is not None:
                cause, lead = warn
                pending = _Pending(t + int(round(lead)), cause, float(int(round(lead))), None)
                step_events.append(Event(float(t), EventKind.WARNING, cause, pending.lead_s))

        if recording:
            if t == 0 and was_on and step_events and step_events[0].kind is EventKind.CUT:
                # On through the warm-up and cut at t=0 itself: the recorded payload starts off,
                # so its trace cannot start with that cut (a cut must end a window the trace
                # holds). The cut still happened: its off time and latches hold from t=0, and a
                # warning issued for it during the warm-up was never recorded.
                step_events.pop(0)
            if t == 0 and on and not any(e.kind is EventKind.POWER_ON for e in step_events):
                # The payload is already on when recording starts: open the window at t=0. A
                # warning issued during the warm-up is re-issued at t=0 with what is left of its
                # lead, so the cut's lead is what the recorded payload actually gets.
                step_events.insert(0, Event(0.0, EventKind.POWER_ON))
                if (
                    pending is not None
                    and pending.warning_index is None
                    and not any(e.kind is EventKind.WARNING for e in step_events)
                ):
                    pending.lead_s = float(pending.t_s)
                    step_events.insert(1, Event(0.0, EventKind.WARNING, pending.cause, pending.lead_s))
            for event in step_events:
                if event.kind is EventKind.WARNING:
                    assert pending is not None
                    pending.warning_index = len(events)
                events.append(event)

        voltage, battery_current = bus_state(t, on)
        if recording:
            telemetry.append(
                TelemetrySample(
                    float(t),
                    round(voltage if voltage is not None else 0.0, 2),
                    round(soc, 3),
                    round(payload_c, 1),
                    round(pwr.payload_load_w if on else 0.0, 2),
                )
            )

        # ---- advance the physics from t to t + 1
        soc += pack_voltage(soc) * battery_current / (3600.0 * pwr.battery_capacity_wh)
        soc = min(1.0, max(0.0, soc))
        structure_target = th.structure_sun_c if orbit.sunlit(t) else th.structure_eclipse_c
        structure_c = structure_target + (structure_c - structure_target) * structure_decay
        payload_target = structure_c + (th.load_rise_c if on else 0.0)
        payload_c = payload_target + (payload_c - payload_target) * payload_decay

    if pending is not None and pending.warning_index is not None:
        # The announced cut falls after the end of the trace: the recorded payload never sees it,
        # and the format has no warnings without their cut, so the warning goes.
        events.pop(pending.warning_index)

    return Trace(
        name=name or config.kind,
        description=config.description,
        duration_s=float(duration),
        events=tuple(events),
        telemetry=tuple(telemetry),
        telemetry_period_s=1.0,
        reference_request_s=config.reference_request_s,
        time_scale=1.0,
        source={
            "kind": "generator",
            "generator": "traces.generator.simulate",
            "satellite": config.kind,
            "seed": seed,
            "parameters": config.parameters(),
        },
        assumptions=config.assumptions,
    )
