"""The chaos campaign (docs/hil.md "Red team"): the kill campaign's cuts and bus kills, mixed with
what else the environment does to a payload -- its data disk filling up and freeing again,
turning read-only, failing with EIO, stalling its fsyncs; the kernel's OOM killer; a second
ground station flooding the link -- while a probe station PINGs the payload every few seconds.

    ChaosCampaign(out_dir, model, faults=500).run()    campaign-report.json, ChaosReport

Every fault is drawn at a random instant from the campaign's seed and counted by kind:

    cut         the bus cuts the payload (SIGKILL) at the end of a trace window (KillCampaign)
    bus_kill    the bus itself is SIGKILLed and restarted on its store (KillCampaign)
    full        the payload's data directory has no free byte for a few seconds, then room again
    flap        full and free in turns, a few times, each a fraction of a second to 1.5 s
    read_only   the data directory refuses every write (EROFS) for a few seconds
    eio         every write and fsync fails with EIO for a few seconds
    stall       every fsync there waits 2-6 s, for a few seconds
    oom         SIGKILL of the payload from outside the bus, as the kernel's OOM killer does: the
                bus sees the payload exit by itself and answers with FDIR (a power cycle)
    flood       a second station sends a burst of several hundred PINGs as fast as it can

The storage faults go through the payload's fault injection (`OW_STORAGE_FAULTS`,
common/durable.py): the campaign's bus worker gets the variable, its zygote and every payload
inherit it, and the control file names only the payload's data directory, so the bus's own
store and run log are never touched.

The verdict (`ChaosReport`) adds to the kill campaign's lost / run twice / answered wrong:
crash loops as chaos defines them (any payload exit, FDIR power cycle, quarantine or boot-loop
hold that an injected OOM kill does not explain), the payload's fault events (a storage
condition must never produce one), and the probe's PINGs unanswered after 5 s although the
payload was powered and connected from the PING until 5 s after it. Each must be 0.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from common import log
from common.durable import FAULTS_ENV
from common.wire import NodeId, ResponseCode
from common.wire import messages as m
from common.wire.ids import SEQ_MODULUS
from common.wire.link import DEFAULT_CLIENTS, Endpoints, init_keys
from ground.client.session import RESYNC_CODES
from ground.errors import CommandRejected, GroundError
from ground.link import GroundLink
from hil.bus import buslog as bl
from hil.redteam import CampaignReport, KillCampaign

#: Injected by this campaign (the cuts and bus kills are KillCampaign's).
STORAGE_KINDS = ("full", "flap", "read_only", "eio", "stall")
INJECTED_KINDS = (*STORAGE_KINDS, "oom", "flood")
FAULT_KINDS = ("cut", "bus_kill", *INJECTED_KINDS)
#: Share of each kind in a campaign of N faults (each kind at least once).
FAULT_MIX = {
    "cut": 0.30,
    "bus_kill": 0.04,
    "full": 0.10,
    "flap": 0.10,
    "read_only": 0.10,
    "eio": 0.08,
    "stall": 0.10,
    "oom": 0.06,
    "flood": 0.12,
}
#: Payload events that mean a fault was charged to a task or a thread failed: each is a failure
#: (an ABNORMAL_EXIT in the boot right after an injected OOM kill is the one expected exception).
FAILURE_EVENTS = (
    "ABNORMAL_EXIT",
    "ITEM_QUARANTINED",
    "TASK_FAILED",
    "WORKER_FAULT",
    "MAIN_LOOP_FAULT",
    "COMMAND_FAULT",
    "REPORT_FAULT",
    "FATAL_ERROR",
)
STORAGE_EVENTS = (
    "STORAGE_FULL",
    "STORAGE_READ_ONLY",
    "STORAGE_ERROR",
    "STORAGE_RESTORED",
    "STORAGE_STALL",
    "DISK_FULL",
)
#: The run-log entry of the bus's boot-loop guard holding a payload off.
#: A PING must be answered within this many seconds while the payload is powered and connected.
PING_DEADLINE_S = 5.0
#: Refusals an uplink waits out and tries again, as an operator would: the environment's (storage)
#: and the bus's limits on a station.
RETRY_CODES = frozenset(
    {
        ResponseCode.STORAGE_FULL,
        ResponseCode.STORAGE_READ_ONLY,
        ResponseCode.STORAGE_ERROR,
        ResponseCode.BUS_STORAGE_FULL,
        ResponseCode.RATE_LIMITED,
        ResponseCode.STATION_QUOTA,
    }
)
PROBE, FLOOD = "probe", "flood"


def make_station_keys(keys_dir: str) -> dict[str, int]:
    """The campaign's keys, and the source id each ground station speaks as: the uplinking
    `ground`, the `probe` and the `flood` station, each with its own key pair and replay window.
    The one place the campaign creates keys: where keys init binds each client key to a source
    id, read the ids from those bindings here."""
    init_keys(keys_dir, clients=(*DEFAULT_CLIENTS, PROBE, FLOOD))
    return {"ground": int(NodeId.GROUND), PROBE: 0x0010, FLOOD: 0x0011}


@dataclass(frozen=True)
class FaultPlan:
    kills: int  # trace cuts
    bus_kill_every: int  # cuts between bus kills
    bus_kills: int
    injected: tuple[str, ...]  # the injected faults, in the order they come

    @property
    def total(self) -> int:
        return self.kills + self.bus_kills + len(self.injected)

    def describe(self) -> str:
        injected = Counter(self.injected)
        kinds = ", ".join(f"{k} {injected[k]}" for k in INJECTED_KINDS)
        every = f"every {self.bus_kill_every} cuts"
        return f"{self.total} faults: cut {self.kills}, bus_kill {self.bus_kills} ({every}), {kinds}"


def plan_faults(faults: int, seed: int, mix: dict[str, float] | None = None) -> FaultPlan:
    """`faults` faults in the shares of `mix` (FAULT_MIX), each kind at least once: how many
    trace cuts, a bus kill every how many cuts, and the injected faults in a seeded order."""
    mix = mix or FAULT_MIX
    if faults < len(FAULT_KINDS):
        raise ValueError(f"a chaos campaign needs at least {len(FAULT_KINDS)} faults (one of each kind), got {faults}")
    kills = max(2, round(faults * mix["cut"]))
    bus_kills = max(1, round(faults * mix["bus_kill"]))
    every = max(1, (kills - 1) // bus_kills)
    bus_kills = min(bus_kills, (kills - 1) // every)
    rest = faults - kills - bus_kills
    rng = random.Random(seed * 7919 + 1)
    weights = [mix[k] for k in INJECTED_KINDS]
    kinds = list(INJECTED_KINDS) + rng.choices(INJECTED_KINDS, weights, k=max(0, rest - len(INJECTED_KINDS)))
    rng.shuffle(kinds)
    return FaultPlan(kills=kills, bus_kill_every=every, bus_kills=bus_kills, injected=tuple(kinds))


@dataclass
class ChaosReport(CampaignReport):
    faults: int = 0
    faults_by_kind: dict = field(default_factory=dict)
    oom_kills_attempted: int = 0  # SIGKILLs sent; faults_by_kind["oom"] counts those the bus saw as exits
    oom_fdir_cycles: int = 0  # FDIR's answers to them (expected)
    oom_abnormal_exits: int = 0  # ABNORMAL_EXIT events in the boot after one (expected, by design)
    other_exits: int = 0  # payload exits no OOM kill explains (crash loops)
    other_fdir_cycles: int = 0
    boot_loop_holds: int = 0
    failure_events: dict = field(default_factory=dict)  # FAILURE_EVENTS seen, by name: must be empty
    storage_events: dict = field(default_factory=dict)  # how the payload reported the spells
    uplink_refusals: dict = field(default_factory=dict)  # waited out and tried again, by code
    flood_pings: int = 0
    pings_sent: int = 0
    pings_counted: int = 0  # sent while powered and connected, and still so 5 s later
    pings_late: list = field(default_factory=list)  # of those: no PONG within 5 s (must be empty)
    pings_rejected: list = field(default_factory=list)  # the probe's PINGs REJECTED (must be empty)
    ping_p50_s: float | None = None
    ping_p99_s: float | None = None
    ping_max_s: float | None = None

    @property
    def passed(self) -> bool:
        return super().passed and not (self.failure_events or self.pings_late or self.pings_rejected)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {self.faults_by_kind.get(k, 0)}" for k in FAULT_KINDS)
        return (
            f"{self.faults} faults ({kinds}); {self.tasks} tasks ({self.completed} answered): lost {len(self.lost)}, "
            f"run twice {len(self.run_twice)}, answered wrong {len(self.answered_wrong)}, crash loops "
            f"{self.crash_loops} (exits {self.other_exits}, FDIR {self.other_fdir_cycles}, quarantined "
            f"{len(self.quarantined)}, boot-loop holds {self.boot_loop_holds}), fault events "
            f"{sum(self.failure_events.values())}, PINGs late {len(self.pings_late)} of {self.pings_counted} "
            f"counted ({self.pings_sent} sent, slowest {_seconds(self.ping_max_s)}, p99 {_seconds(self.ping_p99_s)}), "
            f"PINGs rejected {len(self.pings_rejected)}; {self.wall_s:.0f} s"
        )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


# --- the stations ----------------------------------------------------------------------------------


@dataclass
class PingRecord:
    key: int
    seq: int
    sent: float  # time.time(), the clock of the run log's `utc`
    delivered: bool = True  # False: the bus was not there to take it
    answered: float | None = None
    rejected: str | None = None


class Probe(threading.Thread):
    """A ground station that PINGs the payload every `every_s` and notes when each PONG comes
    (from either link, the first copy), until `stop`."""

    def __init__(self, keys: str, source_id: int, endpoints: Endpoints, every_s: float, seed: int):
        super().__init__(name="chaos-probe", daemon=True)
        self.link = GroundLink(keys, station=PROBE, endpoints=endpoints, handshake_timeout_s=60.0)
        self.source_id = source_id
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.pings: list[PingRecord] = []
        self.error: str | None = None

    def run(self) -> None:
        by_key: dict[int, PingRecord] = {}
        by_seq: dict[int, PingRecord] = {}
        seq = self.rng.randrange(SEQ_MODULUS)
        try:
            self.link.open()
            due = time.monotonic()
            while not self.stop.is_set():
                if time.monotonic() >= due:
                    seq = (seq + 1) % SEQ_MODULUS
                    record = PingRecord(key=self.rng.getrandbits(32), seq=seq, sent=time.time())
                    try:
                        self.link.send(m.Ping(key=record.key), seq, source_id=self.source_id, timeout_s=0.5)
                    except GroundError:
                        record.delivered = False
                    self.pings.append(record)
                    by_key[record.key], by_seq[seq] = record, record
                    due = max(due + self.every_s, time.monotonic() + self.every_s / 2)
                for packet in self.link.receive(max(0.0, min(0.2, due - time.monotonic()))):
                    msg = packet.message
                    if isinstance(msg, m.Pong) and msg.key in by_key:
                        pong = by_key.pop(msg.key)
                        pong.answered = packet.received_at
                    elif isinstance(msg, m.Rejected) and msg.request.source_id == self.source_id:
                        refused = by_seq.get(msg.request.seq)
                        if refused is not None and refused.answered is None:
                            refused.rejected = msg.code.name
                        if msg.code in RESYNC_CODES and msg.highest_seq is not None:
                            seq = msg.highest_seq  # behind or too far ahead: go on after its highest
        except Exception as exc:  # noqa: BLE001 - reported: a probe that stopped measures nothing
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.link.close()


class FloodStation:
    """A second ground station in its own process (`python -m hil.chaos flood-worker SPEC`), so
    that its sending competes with the probe as another station would, not inside the probe's
    interpreter. `burst(n)` has it send n PINGs back to back; `close()` returns how many it sent."""

    def __init__(self, out_dir: str, keys: str, source_id: int, endpoints: Endpoints, nice: int = 0):
        spec = {
            "keys": keys,
            "source_id": source_id,
            "endpoints": asdict(endpoints),
        }
        path = os.path.join(out_dir, "flood-spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "hil.chaos", "flood-worker", path]
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        self.stderr = open(os.path.join(out_dir, "flood-stderr.log"), "ab")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, start_new_session=True
        )

    def burst(self, pings: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{pings}\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        """Stop the worker; the PINGs it sent in all."""
        sent = 0
        try:
            out, _ = self.proc.communicate("quit\n", timeout=60)
            for line in out.splitlines():
                sent += int(json.loads(line).get("sent", 0))
        except (subprocess.TimeoutExpired, ValueError, OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        finally:
            self.stderr.close()
        return sent


def flood_worker(spec_path: str) -> int:
    """The flood station: for each number N read from stdin, N PINGs as fast as the link takes
    them (a line of JSON on stdout each burst); answers are read and dropped, except to move the
    sequence counter on when the payload says it is behind or too far ahead; `quit` ends it."""

    import queue

    log.setup("error", component="flood")
    spec = json.load(open(spec_path))
    source_id = int(spec["source_id"])
    link = GroundLink(spec["keys"], station=FLOOD, endpoints=Endpoints(**spec["endpoints"]), telemetry=False)
    link.open()
    seq = random.randrange(SEQ_MODULUS)
    orders: queue.Queue[str] = queue.Queue()

    def read_orders() -> None:  # a thread, so that the link is drained while no order comes
        for order in sys.stdin:
            orders.put(order)
        orders.put("")

    threading.Thread(target=read_orders, daemon=True).start()

    def drain(timeout_s: float) -> None:
        nonlocal seq
        for packet in link.receive(timeout_s):
            msg = packet.message
            if isinstance(msg, m.Rejected) and msg.code in RESYNC_CODES and msg.highest_seq is not None:
                seq = msg.highest_seq

    try:
        while True:
            try:
                line = orders.get(timeout=0.05)
            except queue.Empty:
                drain(0.05)
                continue
            if not line or line.strip() == "quit":
                return 0
            started, sent = time.monotonic(), 0
            for _ in range(int(line)):
                seq = (seq + 1) % SEQ_MODULUS
                try:
                    link.send(m.Ping(key=random.getrandbits(32)), seq, source_id=source_id, timeout_s=1.0)
                except GroundError:
                    break  # the bus is not there (killed, restarting): this burst ends here
                sent += 1
            print(json.dumps({"sent": sent, "seconds": round(time.monotonic() - started, 3)}), flush=True)
            drain(0.05)
    finally:
        link.close()


# --- the storage faults ------------------------------------------------------------------------------


class StorageControl:
    """The payload's OW_STORAGE_FAULTS control file, rewritten atomically for each change (every
    DurableFS of the payload reads it again when it changes), scoped to the payload's data dir."""

    def __init__(self, path: str, data_dir: str):
        self.path, self.under = path, [data_dir]
        self.set("ok")

    def set(self, mode: str, *, free_bytes: int | None = None, stall_s: float = 0.0) -> None:
        spec: dict = {"mode": mode, "under": self.under, "stall_s": stall_s}
        if free_bytes is not None:
            spec["free_bytes"] = free_bytes
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(spec, f)
        os.replace(tmp, self.path)


# --- the campaign ----------------------------------------------------------------------------------------


class ChaosCampaign(KillCampaign):
    """KillCampaign's run, bus worker, trace, pacer, ground and verdict, plus an injector thread
    that brings the plan's storage spells, OOM kills and floods, a probe station and a flood
    station (module docstring). Injected fault i waits until i/n of the trace cuts are done, so
    the kinds mix across the whole campaign; then comes at a random instant (0-1 s later).

    OOM kills are spaced so that healthy tasks progress between them (health and safety counts
    an OOM kill against the item in hand, by design, and quarantines an item at three in a row
    without progress): one comes only while the payload is connected, has reported
    `oom_after_units` units of work in this boot, and its disk has been left alone for
    `OOM_CALM_S`. The ground uplinks tasks until the last injected fault is done (at least `tasks`),
    `outstanding` unanswered at a time, so the payload is at work throughout.
    `task_shape`, `pace_ms`, `boot_s`, `outstanding`, `nice` are KillCampaign's;
    `work_s` too, longer by default (1-10 s): a PING counts only where the payload stays
    connected for the 5 s after it, so windows must often outlast that."""

    #: The bus's own default (docs/bus.md): a stalled disk must not look like a hung payload.
    HEARTBEAT_TIMEOUT_S = 10.0
    #: Seconds after a storage spell before an OOM kill (the payload's state is on disk again).
    OOM_CALM_S = 3.0
    #: Longest wait for a moment to OOM-kill; past it the kill is skipped and noted.
    OOM_WAIT_S = 300.0

    def __init__(
        self,
        out_dir: str,
        model: str,
        faults: int = 500,
        seed: int = 0,
        *,
        spell_s: tuple[float, float] = (2.0, 5.0),
        stall_s: tuple[float, float] = (2.0, 6.0),
        flap_s: tuple[float, float] = (0.3, 1.5),
        flood_pings: tuple[int, int] = (200, 600),
        gap_s: tuple[float, float] = (0.5, 2.0),
        probe_every_s: float = 2.0,
        oom_after_units: int = 2,
        tasks: int | None = None,
        work_s: tuple[float, float] = (1.0, 10.0),
        **kill_campaign,
    ):
        self.plan = plan_faults(faults, seed)
        super().__init__(
            out_dir,
            model,
            kills=self.plan.kills,
            bus_kill_every=self.plan.bus_kill_every,
            seed=seed,
            tasks=tasks or 0,
            work_s=work_s,
            **kill_campaign,
        )
        self.bus_kills_planned = self.plan.bus_kills
        self.spell_s, self.stall_s, self.flap_s, self.gap_s = spell_s, stall_s, flap_s, gap_s
        self.flood_pings = flood_pings
        self.probe_every_s = probe_every_s
        self.oom_after_units = oom_after_units
        self.chaos_rng = random.Random(seed * 104_729 + 3)
        self.injected: Counter[str] = Counter()
        self.oom_kills: list[tuple[int, float]] = []  # (pid, time.time()) of each SIGKILL sent
        self.injector_done = threading.Event()
        #: the payload has come up once on its new data directory (its commissioning boot)
        self.commissioned = threading.Event()
        self.halt = threading.Event()
        self.storage_calm_since = time.monotonic()
        self.bus_pid: int | None = None
        self.boot_units = 0  # PROGRESS reports of the payload's current boot, as the run log says
        self.uplink_refusals: Counter[str] = Counter()
        self.injector_notes: list[str] = []
        self.injector_error: str | None = None
        self.probe: Probe | None = None
        self.flood: FloodStation | None = None
        self.injector: threading.Thread | None = None

    # -- KillCampaign's hooks -------------------------------------------------------------------------
    def _prepare(self) -> None:
        self.source_ids = make_station_keys(self.keys)
        self.storage = StorageControl(os.path.join(self.out, "storage-faults.json"), self.payload_dir)

    def _new_report(self) -> ChaosReport:
        return ChaosReport()

    @property
    def payload_dir(self) -> str:
        """The payload's data directory (the bus's default: `payload` in its own)."""
        return os.path.join(self.out, "bus", "payload")

    def _bus_env(self) -> dict:
        return {**os.environ, FAULTS_ENV: self.storage.path}

    def _start_bus(self, start_at_s: float):
        proc = super()._start_bus(start_at_s)
        self.bus_pid = proc.pid
        return proc

    def _kill_bus(self, bus) -> None:
        self.bus_pid = None
        super()._kill_bus(bus)

    def _started(self, report) -> None:
        self.probe = Probe(self.keys, self.source_ids[PROBE], self.endpoints, self.probe_every_s, self.seed + 17)
        self.probe.start()
        self.flood = FloodStation(self.out, self.keys, self.source_ids[FLOOD], self.endpoints, nice=self.nice)
        self.injector = threading.Thread(target=self._inject, name="chaos-injector", daemon=True)
        self.injector.start()

    def _observe(self, entries: list) -> None:
        for e in entries:
            if e.kind == bl.PAYLOAD_CONNECTED:
                self.commissioned.set()
            if e.kind in (bl.RUN_START, bl.POWER_ON, bl.POWER_OFF, bl.PAYLOAD_EXITED):
                self.boot_units = 0
            elif e.kind == bl.PAYLOAD_REPORT and e.data.get("type") == "PROGRESS":
                self.boot_units += 1

    def _windows(self) -> int:
        # one per cut and one per bus kill (a killed bus's restart skips the rest of its window),
        # and spares: a restart can land a window further on, and a campaign whose trace ran out
        # of cuts ended short of its plan (498 of 500 faults). Once the plan's cuts are done the
        # bus is restarted in the last window, on for good (_settle).
        return self.plan.kills + self.plan.bus_kills + max(4, self.plan.bus_kills)

    def _want_task(self, uplinked: int) -> bool:
        # work for the payload until the last fault: an OOM kill waits for a payload at work
        return uplinked < self.tasks_target or not self.injector_done.is_set()

    def _in_last_window(self) -> bool:
        return self.log.trace_cuts >= self.kills or self.log.last_trace_s >= self.settle_start

    def _settle(self, bus):
        if self.log.last_trace_s >= self.settle_start and bus.poll() is None:
            return bus  # power stays on already: a restart would only cost a zygote's imports
        return super()._settle(bus)  # the plan's cuts are done before the spare windows: skip them

    def _faults_done(self) -> bool:
        # every injected fault, and every trace window cut (KillCampaign would stop one window
        # early and skip its cut with a bus restart)
        return self.injector_done.is_set() and self._in_last_window()

    def _stopping(self, report) -> None:
        self.halt.set()
        if self.injector is not None:
            self.injector.join(60)
        self.storage.set("ok")
        if self.probe is not None:
            if self.probe.is_alive() and self._in_last_window():
                # its last PINGs, in the window that stays on, are followed for their full 5 s
                time.sleep(PING_DEADLINE_S + self.probe_every_s)
            self.probe.stop.set()
            self.probe.join(30)
        if self.flood is not None:
            report.flood_pings = self.flood.close()

    def _uplink(self, ground, task_id: str, paths: list[str], prompt: str, tokens: int, report) -> bool:
        """An uplink refused for the environment's sake (a storage condition) or by a station
        limit is sent again a second later, as an operator would; any other refusal is noted."""
        while not self.halt.is_set():
            try:
                ground.uplink(paths, prompt, max_new_tokens=tokens, task_id=task_id)
                return True
            except CommandRejected as exc:
                if exc.code not in RETRY_CODES:
                    report.notes.append(f"uplink {task_id}: {exc}")
                    return False
                self.uplink_refusals[exc.code.name] += 1
                self.halt.wait(1.0)
            except GroundError as exc:
                report.notes.append(f"uplink {task_id}: {exc}")
                return False
        return False

    # -- the injector ---------------------------------------------------------------------------------
    def _inject(self) -> None:
        rng, plan = self.chaos_rng, self.plan.injected
        try:
            # Faults begin once the payload has booted on its new data directory: that first boot
            # creates the directories every later boot writes in (commissioning, not flight).
            while not self.halt.is_set() and not self.commissioned.is_set():
                self.halt.wait(0.2)
            for i, kind in enumerate(plan):
                due_cuts = i * self.kills // len(plan)
                # Faults follow the cuts; once the trace's last window runs (power stays on, no
                # cut comes any more: bus restarts skip the cuts of the windows they were killed
                # in), the rest follow each other. Waiting for cuts there hung the campaign.
                while not self.halt.is_set() and self.log.trace_cuts < due_cuts and not self._in_last_window():
                    self.halt.wait(0.2)
                if self.halt.wait(rng.uniform(0.0, 1.0)):
                    return
                getattr(self, f"_inject_{kind}")(rng)
                if self.halt.wait(rng.uniform(*self.gap_s)):
                    return
        except Exception as exc:  # noqa: BLE001 - the campaign must end (and say why), not hang
            self.injector_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.storage.set("ok")
            self.injector_done.set()

    def _spell(self, kind: str, seconds: float, mode: str, **how) -> None:
        self.storage.set(mode, **how)
        self.injected[kind] += 1
        self.halt.wait(seconds)
        self.storage.set("ok")
        self.storage_calm_since = time.monotonic()

    def _inject_full(self, rng: random.Random) -> None:
        self._spell("full", rng.uniform(*self.spell_s), "full", free_bytes=0)

    def _inject_read_only(self, rng: random.Random) -> None:
        self._spell("read_only", rng.uniform(*self.spell_s), "read_only")

    def _inject_eio(self, rng: random.Random) -> None:
        self._spell("eio", rng.uniform(*self.spell_s), "eio")

    def _inject_stall(self, rng: random.Random) -> None:
        stall = rng.uniform(*self.stall_s)
        self._spell("stall", max(stall, rng.uniform(*self.spell_s)), "ok", stall_s=stall)

    def _inject_flap(self, rng: random.Random) -> None:
        self.injected["flap"] += 1
        for _ in range(rng.randint(3, 6)):
            self.storage.set("full", free_bytes=0)
            if self.halt.wait(rng.uniform(*self.flap_s)):
                break
            self.storage.set("ok")
            if self.halt.wait(rng.uniform(*self.flap_s)):
                break
        self.storage.set("ok")
        self.storage_calm_since = time.monotonic()

    def _inject_flood(self, rng: random.Random) -> None:
        assert self.flood is not None  # started before the injector
        self.flood.burst(rng.randint(*self.flood_pings))
        self.injected["flood"] += 1

    def _inject_oom(self, rng: random.Random) -> None:
        give_up = time.monotonic() + self.OOM_WAIT_S
        while not self.halt.is_set():
            if (
                self.boot_units >= self.oom_after_units
                and time.monotonic() - self.storage_calm_since >= self.OOM_CALM_S
            ):
                self.halt.wait(rng.uniform(0.0, 1.0))  # a random instant of its working life
                pid = self._payload_pid()
                if pid is not None and self.boot_units >= self.oom_after_units:
                    os.kill(pid, signal.SIGKILL)
                    self.oom_kills.append((pid, time.time()))
                    self.injected["oom"] += 1
                    return
            if time.monotonic() > give_up:
                self.injector_notes.append(f"OOM kill skipped: no payload at work for {self.OOM_WAIT_S:g} s")
                return
            self.halt.wait(0.2)

    def _payload_pid(self) -> int | None:
        """The payload's pid from the bus's pid file, if it is alive, leads its own session and
        descends from the current bus worker (directly, or through its zygote)."""
        try:
            pid = int(open(os.path.join(self.out, "bus", "payload.pid")).read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        bus = self.bus_pid
        stat = _proc_stat(pid)
        if bus is None or stat is None or stat[0] == "Z" or stat[2] != pid:
            return None
        parent = _proc_stat(stat[1])
        return pid if stat[1] == bus or (parent is not None and parent[1] == bus) else None

    # -- the verdict ----------------------------------------------------------------------------------
    def _verify(self, report, specs: dict, results: dict, log_path: str) -> None:
        super()._verify(report, specs, results, log_path)
        entries = bl.read_log(log_path)
        oom_exits = self._judge_exits(report, entries)
        self._judge_pings(report, entries)
        report.faults_by_kind = {
            "cut": report.payload_kills,
            "bus_kill": report.bus_kills,
            **{k: self.injected[k] for k in STORAGE_KINDS},
            "oom": oom_exits,
            "flood": self.injected["flood"],
        }
        report.faults = sum(report.faults_by_kind.values())
        report.oom_kills_attempted = len(self.oom_kills)
        report.uplink_refusals = dict(self.uplink_refusals)
        report.notes.extend(self.injector_notes)
        for what, error in (("injector", self.injector_error), ("probe", self.probe and self.probe.error)):
            if error:
                report.notes.append(f"{what} failed: {error}")

    def _judge_exits(self, report: ChaosReport, entries) -> int:
        """Which exits, FDIR cycles and ABNORMAL_EXIT events the injected OOM kills explain:
        the exit of a payload we SIGKILLed (same pid, after the kill), the FDIR cycle that
        answers it, and ABNORMAL_EXIT events of the boot that follows. Everything else counts."""
        kills = list(self.oom_kills)
        failures: Counter[str] = Counter()
        storage: Counter[str] = Counter()
        pid, oom_exit, after_oom = None, False, False
        oom_exits = 0
        for e in entries:
            d = e.data
            if e.kind == bl.RUN_START:
                pid, oom_exit, after_oom = None, False, False
            elif e.kind == bl.POWER_ON:
                pid, after_oom = d.get("pid"), oom_exit
                oom_exit = False
            elif e.kind == bl.PAYLOAD_EXITED:
                match = next((k for k in kills if k[0] == pid and k[1] <= e.utc + 1.0), None)
                if match is not None:
                    kills.remove(match)
                    oom_exits += 1
                    oom_exit = True
                else:
                    report.other_exits += 1
            elif e.kind == bl.FDIR_ACTION:
                if oom_exit:
                    report.oom_fdir_cycles += 1
                else:
                    report.other_fdir_cycles += 1
            elif e.kind == bl.BUS_EVENT and d.get("event") == "PAYLOAD_BOOT_LOOP":
                report.boot_loop_holds += 1
            elif e.kind == bl.PAYLOAD_REPORT and d.get("type") == "EVENT":
                name = d.get("event")
                if name == "ABNORMAL_EXIT" and after_oom:
                    report.oom_abnormal_exits += 1
                elif name in FAILURE_EVENTS:
                    failures[name] += 1
                elif name in STORAGE_EVENTS:
                    storage[name] += 1
        report.failure_events = dict(failures)
        report.storage_events = dict(storage)
        report.crash_loops = (
            report.other_exits + report.other_fdir_cycles + len(report.quarantined) + report.boot_loop_holds
        )
        return oom_exits  # the OOM kills that landed (one sent as the bus cut the payload did not)

    def _judge_pings(self, report: ChaosReport, entries) -> None:
        """The probe's PINGs against the run log: a PING counts when the payload was connected
        when it was sent (a payload_connected entry after the last power change) and nothing
        ended that -- no power-off, exit, FDIR action, bus stop or kill, OOM kill -- until 5 s
        after it. Of those, each without a PONG within 5 s is late."""
        starts, ends = [], [t for _, t in self.oom_kills] + list(self.bus_killed_at)
        for e in entries:
            if e.kind == bl.PAYLOAD_CONNECTED:
                starts.append(e.utc)
            elif e.kind in (bl.POWER_OFF, bl.PAYLOAD_EXITED, bl.FDIR_ACTION, bl.RUN_STOP, bl.RUN_START):
                ends.append(e.utc)
            elif e.kind == bl.HEARTBEAT_GAP and e.data.get("action") == "power_cycle":
                ends.append(e.utc)
        starts.sort()
        ends.sort()
        latencies = []
        pings = self.probe.pings if self.probe is not None else []
        report.pings_sent = sum(1 for p in pings if p.delivered)
        t0 = pings[0].sent if pings else 0.0
        for p in pings:
            if p.rejected:
                report.pings_rejected.append(f"PING at +{p.sent - t0:.1f} s: {p.rejected}")
            if not p.delivered or not _connected_throughout(starts, ends, p.sent, p.sent + PING_DEADLINE_S):
                continue
            report.pings_counted += 1
            waited = None if p.answered is None else p.answered - p.sent
            if waited is not None:
                latencies.append(waited)
            if waited is None or waited > PING_DEADLINE_S:
                what = "no PONG" if waited is None else f"PONG after {waited:.2f} s"
                report.pings_late.append(f"PING at +{p.sent - t0:.1f} s (utc {p.sent:.3f}): {what}")
        if latencies:
            latencies.sort()
            report.ping_p50_s = round(latencies[len(latencies) // 2], 3)
            report.ping_p99_s = round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3)
            report.ping_max_s = round(latencies[-1], 3)


def _connected_throughout(starts: list[float], ends: list[float], t0: float, t1: float) -> bool:
    """Whether a connection began at or before t0 after the last end before t0, and no end
    falls in [t0, t1]."""
    last_start = bisect.bisect_right(starts, t0) - 1
    last_end = bisect.bisect_right(ends, t0) - 1
    if last_start < 0 or (last_end >= 0 and ends[last_end] >= starts[last_start]):
        return False
    nxt = bisect.bisect_left(ends, t0)
    return nxt == len(ends) or ends[nxt] > t1


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[3])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "flood-worker":
        raise SystemExit(flood_worker(sys.argv[2]))
    raise SystemExit("usage: python -m hil.chaos flood-worker SPEC (the chaos campaign's flood station)")
