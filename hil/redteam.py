"""The red team, kept: fuzzers for the packet decoder and the payload's dispatch, and a
whole-system kill campaign (docs/hil.md "Red team").

    fuzz_decoder(frames, seed)             every frame: a message, or WireError with a real code
    fuzz_dispatch(frames, seed, workdir)   every telecommand frame into FlightApp.handle_packet:
                                           exactly one ACCEPTED or REJECTED, nothing escapes
    KillCampaign(...).run()                the real bus, payload and ground; the bus cuts the
                                           payload at random instants of its working life
                                           (uplink, compaction, record writes, result reports)
                                           and is itself SIGKILLed now and then; counts tasks
                                           lost, run twice, answered wrong, and crash loops

`make test` runs the fuzzers at a few thousand frames (tests/wire/test_wire_fuzz.py,
tests/flight/test_dispatch_fuzz.py); `python -m bench.redteam` runs everything at full size.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

import msgpack
import numpy as np
from PIL import Image

import traces
from common import log
from common.durable import DurableFS, temp_name
from common.wire import Apid, NodeId, ResponseCode, WireError, decode, encode
from common.wire import messages as m
from common.wire.ids import SEQ_MODULUS, PowerCause
from common.wire.link import Endpoints, init_keys
from common.wire.packet import PacketType, crc16, frame
from flight.checkpoint.policies import Geometry
from flight.runtime.app import FlightApp, FlightConfig
from ground.client import GroundClient, GroundOptions
from ground.errors import CommandRejected, GroundError
from hil.bus import BusConfig, BusThread
from hil.bus import buslog as bl
from traces.model import CutCause, PowerWindow

# --- frames -------------------------------------------------------------------------------------


def sample_commands() -> list[m.Message]:
    """One valid instance of every telecommand (and the bus's two messages to the payload)."""
    image = bytes(range(256)) * 3
    return [
        m.Ping(key=0xDEADBEEF),
        m.Status(),
        m.UplinkTask(
            task_id="task-001",
            prompt="Describe the cloud cover. Ünïcødé ☁",
            images=["img_a.png", "img_b"],
            max_new_tokens=64,
            priority=7,
        ),
        m.CancelTask(task_id="task-001"),
        m.SetPriority(task_id="task-001", priority=255),
        m.DownlinkResult(task_id="task-001"),
        m.ImageChunk.split("img_a.png", image, chunk_bytes=300)[1],
        m.ImageQuery(image="img_a.png"),
        m.ListQuarantine(),
        m.ReleaseQuarantine(item="task:task-001"),
        m.ListLostTasks(),
        m.ShutdownWarning(trace_time_s=100.0, lead_time_s=2.5, cause=PowerCause.ECLIPSE),
        m.PowerStateChange(trace_time_s=102.5, payload_on=True, cause=PowerCause.RESTORED, after_fault=False),
    ]


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(
            [0, 1, -1, 255, 256, 2**32 - 1, 2**32, 2**63, -(2**63), 2**64 - 1, rng.randrange(-(10**6), 10**6)]
        )
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e308, float("inf"), float("nan"), rng.uniform(-1e9, 1e9)])
    if kind == 4:
        return "".join(rng.choice("ab/..\\:\x00é☁ <|im_end|>") for _ in range(rng.randrange(0, 40)))
    if kind == 5:
        return os.urandom(rng.randrange(0, 64))
    if kind == 6:
        return "x" * rng.choice([0, 64, 65, 256, 257, 8192, 8193, 70000])
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {str(_random_value(rng, depth + 1))[:12]: _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


def fix_length_and_crc(packet: bytearray) -> bytes:
    """Make a mutated packet pass the length and CRC checks, so the mutation reaches the body."""
    if len(packet) >= 7:
        packet[4:6] = min(len(packet) - 7, 0xFFFF).to_bytes(2, "big")
    if len(packet) >= 2:
        packet[-2:] = crc16(bytes(packet[:-2])).to_bytes(2, "big")
    return bytes(packet)


class FrameSource:
    """Frames for the decoder and dispatch fuzzers: valid commands with fresh sequence numbers,
    mutated packets (bit flips, byte sets, inserts, deletes, truncations; half of them repaired
    so they pass length and CRC), perturbed bodies, arbitrary bodies and arbitrary bytes."""

    def __init__(self, seed: int, source_id: int = NodeId.GROUND):
        self.rng = random.Random(seed)
        self.samples = sample_commands()
        self.seq = 0
        self.source_id = source_id

    def _next_seq(self) -> int:
        roll = self.rng.random()
        if roll < 0.9:
            self.seq = (self.seq + 1) % SEQ_MODULUS
            return self.seq
        if roll < 0.95:
            return (self.seq - self.rng.randrange(0, 200)) % SEQ_MODULUS  # replays and late ones
        return self.rng.randrange(SEQ_MODULUS)  # anywhere: far ahead, far behind

    def _valid(self) -> bytes:
        sample = self.rng.choice(self.samples)
        apid = Apid.PAYLOAD if sample.is_command() else Apid.BUS
        return encode(sample, apid, self._next_seq(), source_id=self.source_id if sample.is_command() else NodeId.BUS)

    def next(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            return self._valid()
        if roll < 0.65:
            data = bytearray(self._valid())
            for _ in range(rng.randrange(1, 5)):
                op, i = rng.randrange(5), rng.randrange(len(data) + 1) if data else 0
                if op == 0 and i < len(data):
                    data[i] ^= 1 << rng.randrange(8)
                elif op == 1 and i < len(data):
                    data[i] = rng.randrange(256)
                elif op == 2:
                    data[i:i] = os.urandom(rng.randrange(1, 9))
                elif op == 3:
                    del data[i : i + rng.randrange(1, 9)]
                else:
                    del data[i:]
            return fix_length_and_crc(data) if rng.random() < 0.5 else bytes(data)
        if roll < 0.85:
            sample = rng.choice(self.samples)
            body = sample.pack()
            action = rng.randrange(3)
            if action == 0 and body:
                body[rng.choice(sorted(body))] = _random_value(rng)
            elif action == 1 and body:
                del body[rng.choice(sorted(body))]
            else:
                body[str(_random_value(rng))[:12]] = _random_value(rng)
            try:
                raw = msgpack.packb(body, use_bin_type=True)
            except (TypeError, ValueError, OverflowError):
                raw = os.urandom(16)
            kind = PacketType.TC if sample.is_command() else PacketType.TM
            return frame(
                kind, Apid.PAYLOAD, self._next_seq(), sample.TYPE, raw[:65000], source_id=self.source_id, time_us=0
            )
        if roll < 0.95:
            cls = rng.choice(m.all_message_classes())
            try:
                raw = msgpack.packb(_random_value(rng), use_bin_type=True)
            except (TypeError, ValueError, OverflowError):
                raw = b"\xc1"
            kind = PacketType.TC if rng.random() < 0.7 else PacketType.TM
            return frame(
                kind, Apid.PAYLOAD, self._next_seq(), cls.TYPE, raw[:65000], source_id=self.source_id, time_us=0
            )
        return os.urandom(rng.randrange(0, 400))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _finished(report, frames: int, codes: Counter, rss_start: int | None, start: float):
    """Fill in a fuzzer report's totals: frames, rejections by code, memory growth after the
    warm-up, time."""
    report.frames = frames
    report.rejected = dict(codes.most_common())
    report.rss_growth_bytes = _rss_bytes() - (rss_start or _rss_bytes())
    report.seconds = time.perf_counter() - start
    return report


# --- the decoder ---------------------------------------------------------------------------------


@dataclass
class DecoderFuzzReport:
    frames: int = 0
    decoded: int = 0
    rejected: dict = field(default_factory=dict)
    defects: list = field(default_factory=list)  # INTERNAL_ERROR or another exception: must stay empty
    slowest_frame_ms: float = 0.0
    rss_growth_bytes: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.defects


def fuzz_decoder(frames: int, seed: int = 0, progress=None) -> DecoderFuzzReport:
    source, report = FrameSource(seed), DecoderFuzzReport()
    codes: Counter[str] = Counter()
    start, rss_start = time.perf_counter(), None
    for i in range(frames):
        data = source.next()
        t0 = time.perf_counter()
        try:
            header, message = decode(data)
            again = decode(
                encode(
                    message,
                    header.apid,
                    header.seq,
                    source_id=header.source_id,
                    time_us=header.time_us,
                    ack_flags=header.ack_flags,
                )
            )[1]
            if again != message:
                report.defects.append(f"frame {i}: {message.TYPE.name} does not round-trip")
            report.decoded += 1
        except WireError as err:
            codes[err.code.name] += 1
            if err.code == ResponseCode.INTERNAL_ERROR:
                report.defects.append(f"frame {i}: decoder fault {err.reason}")
        except Exception as exc:  # noqa: BLE001 - exactly what the fuzzer looks for
            report.defects.append(f"frame {i}: {type(exc).__name__}: {exc}")
        report.slowest_frame_ms = max(report.slowest_frame_ms, (time.perf_counter() - t0) * 1000)
        if i == min(10_000, frames // 10):
            rss_start = _rss_bytes()  # after warm-up: growth past here is a leak
        if progress and i and i % 100_000 == 0:
            progress(f"decoder: {i} frames, {len(report.defects)} defects")
    return _finished(report, frames, codes, rss_start, start)


# --- the payload's dispatch ----------------------------------------------------------------------


class NoSyncFS(DurableFS):
    """Real files without fsync: the dispatch fuzzer measures dispatch, not the disk."""

    def write_atomic(self, path, chunks):
        tmp = temp_name(path)
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(memoryview(chunk).cast("B"))
        os.replace(tmp, path)
        return os.path.getsize(path)

    def append(self, path, chunks):
        with open(path, "ab") as f:
            return sum(f.write(memoryview(chunk).cast("B")) for chunk in chunks)

    def truncate(self, path, size):
        os.truncate(path, size)

    def fsync_dir(self, path):
        pass


@dataclass
class DispatchFuzzReport:
    frames: int = 0
    command_frames: int = 0
    accepted: int = 0
    rejected: dict = field(default_factory=dict)
    verdict_violations: list = field(default_factory=list)  # not exactly one ACCEPTED/REJECTED
    escaped: list = field(default_factory=list)  # exceptions out of handle_packet
    command_faults: int = 0  # handlers that failed (contained)
    rss_growth_bytes: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.verdict_violations and not self.escaped and not self.command_faults


def fuzz_dispatch(frames: int, seed: int, workdir: str, progress=None) -> DispatchFuzzReport:
    """Every frame straight into the payload's dispatch (a FlightApp without its worker or link):
    a frame addressed to the payload as a telecommand, or one that does not decode, gets exactly
    one ACCEPTED or REJECTED; a telemetry frame gets none; nothing escapes; no handler faults."""

    keys = os.path.join(workdir, "keys")
    init_keys(keys)
    app = FlightApp(
        FlightConfig(
            os.path.join(workdir, "data"), os.path.join(workdir, "no-model"), keys, "tcp://127.0.0.1:1", fs=NoSyncFS()
        )
    )
    source, report = FrameSource(seed), DispatchFuzzReport()
    codes: Counter[str] = Counter()
    start, rss_start = time.perf_counter(), None
    for i in range(frames):
        data = source.next()
        try:
            header, message = decode(data)
            wants_verdict = message.is_command()
        except WireError:
            wants_verdict = True
        try:
            app.handle_packet(data)
        except Exception as exc:  # noqa: BLE001 - exactly what the fuzzer looks for
            report.escaped.append(f"frame {i}: {type(exc).__name__}: {exc}")
        verdicts = 0
        while not app.outbox.empty():
            packet, _ = app.outbox.get_nowait()
            _, out = decode(packet)
            if isinstance(out, m.Accepted):
                verdicts += 1
                report.accepted += 1
            elif isinstance(out, m.Rejected):
                verdicts += 1
                codes[out.code.name] += 1
            elif isinstance(out, m.Event) and out.event_id.name == "COMMAND_FAULT":
                report.command_faults += 1
        report.command_frames += wants_verdict
        if verdicts != (1 if wants_verdict else 0):
            report.verdict_violations.append(f"frame {i}: {verdicts} verdicts: {data[:40].hex()}")
        if i == min(2_000, frames // 10):
            rss_start = _rss_bytes()
        if progress and i and i % 50_000 == 0:
            progress(f"dispatch: {i} frames, {len(report.verdict_violations) + len(report.escaped)} defects")
    return _finished(report, frames, codes, rss_start, start)


def to_dict(report) -> dict:
    out = asdict(report)
    for key in ("defects", "verdict_violations", "escaped"):
        if key in out:
            out[key] = out[key][:20]
    out["passed"] = report.passed
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def digest_frames(frames: int, seed: int) -> str:
    """A fingerprint of the frames a seed gives (so a report names exactly what it fed)."""
    source, h = FrameSource(seed), hashlib.sha256()
    for _ in range(frames):
        h.update(source.next())
    return h.hexdigest()[:16]


# --- the whole-system kill campaign ----------------------------------------------------------------

CAMPAIGN_FLIGHT_ARGS = [
    "--chunk",
    "16",
    "--group",
    "2",
    "--decode-every",
    "2",
    "--vision-every",
    "1",
    "--threads",
    "1",
    "--compact-after",
    "8",
    "--results-budget-mb",
    "2",
]
_WORDS = (
    "count the ships near coast and describe harbor clouds report what is visible below them compare "
    "two scenes list any new damage to roads or fields identify coastline estimate area of sand fire "
    "smoke flood bridge river , ."
).split()


class KillPacer:
    """In the campaign's bus: after each power-up, trace time waits (held) until the payload is at
    work -- connected and, if it has tasks pending (its first housekeeping report says), running
    one -- so that every cut lands at a random instant of its *working* life: uplinks, journal
    appends and compactions, checkpoint records, result reports, whatever the boot and the model
    load cost on this machine. A chosen fraction of power-ups is not waited for: those cuts land
    in the boot."""

    HOLD_LIMIT_S = 180.0

    def __init__(self, window_starts: list[float], boot_kill_fraction: float, seed: int):
        self.starts = window_starts
        self.fraction = boot_kill_fraction
        self.rng = random.Random(seed)
        self.cycle = 0
        self.stage = "done"  # "connect" -> "housekeeping" -> "task" -> "done"
        self.held_since = 0.0

    def payload_message(self, bus, message, now):
        if self.stage == "housekeeping" and isinstance(message, m.Housekeeping):
            self.stage = "task" if message.queue_depth else "done"
        elif self.stage == "task" and isinstance(message, m.Started):
            self.stage = "done"

    def step(self, bus, now):
        clock = bus.clock
        if bus.power_count != self.cycle:
            self.cycle = bus.power_count
            self.stage = "connect" if self.rng.random() >= self.fraction else "done"
            self.held_since = now
        if self.stage == "connect" and bus.payload_rid is not None:
            self.stage = "housekeeping"
        if self.stage == "done" or now - self.held_since > self.HOLD_LIMIT_S:
            self.stage = "done"
            clock.release(now)
            return
        t = clock.trace_s(now)
        index = bisect.bisect_right(self.starts, t) - 1
        start = self.starts[index] if index >= 0 else None
        if start is not None and t >= start + 0.05 and clock.held_at is None and bus.switch.is_on():
            clock.hold(min(now, clock.at(start + 0.05)))


def campaign_trace(
    path: str, kills: int, seed: int, work_s: tuple[float, float], off_s: float = 0.3, settle_s: float = 3600.0
) -> str:
    """`kills` windows, each open 0.05 s of trace time plus a random working time (the pacer holds
    the clock through the boot), cut by a random cause; then power stays on for `settle_s`."""

    rng = random.Random(seed)
    causes = [CutCause.THERMAL, CutCause.POWER, CutCause.FDIR, CutCause.CONTENTION]
    windows, t = [], 0.0
    for _ in range(kills):
        end = t + 0.05 + rng.uniform(*work_s)
        windows.append(PowerWindow(round(t, 3), round(end, 3), rng.choice(causes), 0.0))
        t = end + off_s
    windows.append(PowerWindow(round(t, 3), round(t + settle_s, 3), None, 0.0))
    trace = traces.Trace.from_windows(
        "redteam",
        t + settle_s,
        windows,
        reference_request_s=10.0,
        description="red-team kill campaign: random working windows",
        source={"kind": "generator", "by": "hil.redteam"},
        assumptions=["campaign"],
    )
    traces.dump(trace, path)
    return path


def bus_worker(spec_path: str) -> int:
    """`python -m hil.redteam bus-worker SPEC`: one bus (with the campaign's pacer) until SIGTERM
    or SIGKILL -- a separate process, so that the campaign can kill the bus too."""

    log.setup("warning", component="bus")
    spec = json.load(open(spec_path))
    trace = traces.load(spec["trace"])
    pacer = KillPacer([w.start_s for w in trace.windows()], spec["boot_kill_fraction"], spec["seed"])
    cfg = BusConfig(
        trace=spec["trace"],
        data_dir=spec["data_dir"],
        keys_dir=spec["keys"],
        time_scale=1.0,
        start_at_s=spec["start_at_s"],
        endpoints=Endpoints(**spec["endpoints"]),
        model=spec["model"],
        flight_args=spec["flight_args"],
        fdir_off_s=0.3,
        heartbeat_timeout_s=spec.get("heartbeat_timeout_s", 60.0),
        boot_timeout_s=300.0,
        ready_file=spec["ready_file"],
        boot_trace_s=spec.get("boot_trace_s"),
        # The verdict reads reports and power changes, never the command packets; logged, they
        # would be three quarters of a full-size campaign's run log (hundreds of MB).
        log_packets=False,
        # ... but it reads the whole log: no segment may be dropped however long the campaign.
        log_segments=100_000,
    )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    bus = BusThread(cfg, pacer=pacer).start()
    while not done.wait(0.5) and bus.is_alive():
        pass
    bus.stop()
    return 0


@dataclass
class CampaignReport:
    payload_kills: int = 0  # trace cuts that SIGKILLed a running payload
    bus_kills: int = 0
    kills_by_activity: dict = field(default_factory=dict)
    tasks: int = 0
    completed: int = 0
    lost: list = field(default_factory=list)
    run_twice: list = field(default_factory=list)
    answered_wrong: list = field(default_factory=list)
    crash_loops: int = 0  # payload exits by itself + quarantines + FDIR power cycles
    payload_exits: int = 0
    quarantined: list = field(default_factory=list)
    fdir_cycles: int = 0
    journal_damage_events: int = 0
    wall_s: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.lost or self.run_twice or self.answered_wrong or self.crash_loops)

    def summary(self) -> str:
        return (
            f"{self.payload_kills} payload SIGKILLs ({self.kills_by_activity}), {self.bus_kills} bus SIGKILLs, "
            f"{self.tasks} tasks ({self.completed} answered): lost {len(self.lost)}, run twice "
            f"{len(self.run_twice)}, answered wrong {len(self.answered_wrong)}, crash loops {self.crash_loops}; "
            f"{self.wall_s / 3600:.1f} h"
        )


@dataclass(frozen=True)
class TaskShape:
    """The ranges a campaign's tasks are drawn from (inclusive): pictures per task, their width
    and height in pixels, prompt words, tokens to generate."""

    images: tuple[int, int] = (1, 3)
    width: tuple[int, int] = (32, 320)
    height: tuple[int, int] = (32, 240)
    words: tuple[int, int] = (1, 300)
    tokens: tuple[int, int] = (1, 32)


class RunLogTail:
    """The campaign's view of the bus run log as it grows: `read()` parses only what was appended
    since the last call (a full-size campaign's log grows to tens of MB), keeping the two things
    the campaign steers by: trace cuts so far and the furthest trace time reached.

    The file stays open between calls, so a log rotated away (renamed, a new file in its place)
    is read to its end before the new file is opened."""

    def __init__(self, path: str):
        self.path = path
        self.trace_cuts = 0
        self.last_trace_s = 0.0
        self._file: BinaryIO | None = None
        self._pending = b""  # the start of a line still being written

    def _replaced(self) -> bool:
        assert self._file is not None
        try:
            return os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            return False  # between the rename and the new file

    def read(self) -> list[bl.BusLogEntry]:
        lines: list[bytes] = []
        if self._file is not None and self._replaced():
            # rotated: the rest of the old file (a torn last line stays torn), then the new one
            lines = (self._pending + self._file.read()).splitlines()
            self._file.close()
            self._file, self._pending = None, b""
        if self._file is None:
            try:
                self._file = open(self.path, "rb")
            except FileNotFoundError:
                return self._parse(lines)
        data = self._pending + self._file.read()
        end = data.rfind(b"\n") + 1
        self._pending = data[end:]
        return self._parse(lines + data[:end].splitlines())

    def _parse(self, lines: list[bytes]) -> list[bl.BusLogEntry]:
        entries = []
        for line in lines:
            try:
                entry = bl.BusLogEntry.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # the torn last line of a killed bus
            entries.append(entry)
            if entry.trace_s is not None:
                self.last_trace_s = max(self.last_trace_s, entry.trace_s)
            if entry.kind == bl.POWER_OFF and entry.data.get("origin") == "trace":
                self.trace_cuts += 1
        return entries

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _noise_png(rng: random.Random, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


class KillCampaign:
    """docs/hil.md "Red team": the real bus, payload and ground on loopback; the bus cuts the
    payload `kills` times at random instants of its working life and is itself SIGKILLed every
    `bus_kill_every` cuts (and restarted on the same store); tasks of mixed sizes (1-3 pictures up
    to 320x240, prompts of 1-300 words, 1-32 tokens) are uplinked throughout, up to `outstanding`
    unanswered at a time. Every block and step is paced to at least `pace_ms` (the payload's
    `--pace-ms`, standing in for a slower target) so that the tiny model's tasks last seconds, the
    queue stays full and the cuts land in vision, prefill, decode, record writes and reports rather
    than in an idle payload waiting for the next uplink. With `boot_s` set, each payload is forked
    at power-on from the testbench's zygote (its libraries imported, nothing else; the boot takes
    `boot_s`, docs/hil.md) so that a thousand cuts fit in an afternoon; with None, every power-on
    execs the payload and pays this machine's real cold start (the boot itself is then cut too)."""

    def __init__(
        self,
        out_dir: str,
        model: str,
        kills: int = 1000,
        bus_kill_every: int = 40,
        seed: int = 0,
        tasks: int | None = None,
        work_s: tuple[float, float] = (0.1, 4.0),
        pace_ms: int = 60,
        outstanding: int = 12,
        boot_s: float | None = 1.0,
        boot_kill_fraction: float = 0.1,
        say=print,
        nice: int = 0,
        task_shape: TaskShape | None = None,
    ):
        self.out = os.path.abspath(out_dir)
        self.model = os.path.abspath(model)
        self.kills = kills
        self.bus_kill_every = bus_kill_every
        self.seed = seed
        self.tasks_target = tasks if tasks is not None else max(4, kills)
        self.work_s = work_s
        self.pace_ms = pace_ms
        self.boot_s = boot_s
        self.outstanding = outstanding
        self.boot_kill_fraction = boot_kill_fraction
        self.say = say
        self.nice = nice
        self.task_shape = task_shape or TaskShape()
        self.rng = random.Random(seed)
        #: time.time() of each bus SIGKILL (a run log simply stops there)
        self.bus_killed_at: list[float] = []
        #: one bus kill every `bus_kill_every` cuts, before the last cut
        self.bus_kills_planned = (kills - 1) // bus_kill_every if bus_kill_every else 0

    # -- hooks for campaigns built on this one (hil/chaos.py) --------------------------------------
    def _prepare(self) -> None:
        """Before the first bus starts: the keys (and whatever else the campaign sets up)."""
        init_keys(self.keys)

    def _new_report(self) -> CampaignReport:
        return CampaignReport()

    def _bus_env(self) -> dict | None:
        """The bus worker's environment (its zygote and payloads inherit it); None: this one's."""
        return None

    def _started(self, report: CampaignReport) -> None:
        """The bus is up and the ground is uplinking."""

    def _observe(self, entries: list) -> None:
        """Run-log entries the bus wrote since the last call (about once a second)."""

    def _faults_done(self) -> bool:
        """Whether the campaign's own faults are all done (the cuts are counted apart)."""
        return True

    def _want_task(self, uplinked: int) -> bool:
        """Whether the ground uplinks another task (it keeps up to `outstanding` unanswered)."""
        return uplinked < self.tasks_target

    def _stopping(self, report: CampaignReport) -> None:
        """The campaign is over (or failed): stop what `_started` started. Runs once."""

    #: The campaign's bus gives up on a silent payload late: its cuts, not FDIR, end a window.
    HEARTBEAT_TIMEOUT_S = 60.0

    # -- the bus process --------------------------------------------------------------------------
    def _start_bus(self, start_at_s: float):
        ready = os.path.join(self.out, "bus-ready.json")
        if os.path.exists(ready):
            os.remove(ready)
        spec = {
            "trace": self.trace,
            "data_dir": os.path.join(self.out, "bus"),
            "keys": self.keys,
            "model": self.model,
            "flight_args": CAMPAIGN_FLIGHT_ARGS + (["--pace-ms", str(self.pace_ms)] if self.pace_ms else []),
            "start_at_s": start_at_s,
            "ready_file": ready,
            "boot_kill_fraction": self.boot_kill_fraction,
            "boot_trace_s": self.boot_s,
            "seed": self.rng.randrange(2**31),
            "endpoints": {
                "commands": self.endpoints.commands,
                "payload": self.endpoints.payload,
                "telemetry": self.endpoints.telemetry,
            },
            "heartbeat_timeout_s": self.HEARTBEAT_TIMEOUT_S,
        }
        path = os.path.join(self.out, "bus-spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        log = open(os.path.join(self.out, "bus-stderr.log"), "ab")
        cmd = [sys.executable, "-m", "hil.redteam", "bus-worker", path]
        if self.nice:
            cmd = ["nice", "-n", str(self.nice)] + cmd
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, env=self._bus_env())
        deadline = time.monotonic() + 900  # a zygote's imports take minutes on a loaded machine
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"campaign bus did not start (see {self.out}/bus-stderr.log)")
            time.sleep(0.1)
        return proc

    def _windows(self) -> int:
        """Trace windows to plan: a bus killed in a window costs that window's cut, so enough for
        `kills` cuts and a few more."""
        return self.kills + (self.kills // self.bus_kill_every + 2 if self.bus_kill_every else 0)

    def _settle(self, bus):
        """The cuts are done: a clean bus stop, then a bus started in the trace's last window,
        which keeps the payload on until every task has finished. Returns the running bus."""
        bus.send_signal(signal.SIGTERM)
        bus.wait(120)
        return self._start_bus(self.settle_start)

    def _kill_bus(self, bus) -> None:
        self.bus_killed_at.append(time.time())
        os.killpg(bus.pid, signal.SIGKILL)
        bus.wait()

    def _trace_position(self) -> float:
        """Where the last bus run got to: restart at the next window."""

        nxt = [w.start_s for w in traces.load(self.trace).windows() if w.start_s > self.log.last_trace_s]
        return nxt[0] if nxt else self.log.last_trace_s

    def _uplink(self, ground, task_id: str, paths: list[str], prompt: str, tokens: int, report) -> bool:
        """One task up; False if it was not accepted (noted in the report)."""
        try:
            ground.uplink(paths, prompt, max_new_tokens=tokens, task_id=task_id)
            return True
        except GroundError as exc:
            report.notes.append(f"uplink {task_id}: {exc}")
            return False

    # -- the run ----------------------------------------------------------------------------------------
    def run(self) -> CampaignReport:
        os.makedirs(self.out, exist_ok=True)
        started = time.monotonic()
        self.keys = os.path.join(self.out, "keys")
        self._prepare()
        ports = []
        for _ in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        self.endpoints = Endpoints(*(f"tcp://127.0.0.1:{p}" for p in ports))
        self.trace = campaign_trace(os.path.join(self.out, "trace.jsonl"), self._windows(), self.seed, self.work_s)

        self.settle_start = traces.load(self.trace).windows()[-1].start_s
        report = self._new_report()
        specs: dict[str, dict] = {}
        results: dict[str, object] = {}
        log_path = os.path.join(self.out, "bus", bl.LOG_FILE)
        self.log = RunLogTail(log_path)
        bus = self._start_bus(0.0)
        stop = threading.Event()
        pictures_dir = os.path.join(self.out, "pictures")
        os.makedirs(pictures_dir, exist_ok=True)
        shape = self.task_shape

        def ground_loop():
            n = 0
            with GroundClient(
                self.keys,
                GroundOptions(
                    endpoints=self.endpoints,
                    timeout_s=30.0,
                    retries=10_000,
                    notify=lambda s: None,
                    state_dir=os.path.join(self.out, "ground"),
                ),
            ) as ground:
                while not stop.is_set() and self._want_task(n):
                    rng = random.Random(self.seed * 1_000_003 + n)
                    paths = []
                    for j in range(rng.randint(*shape.images)):
                        path = os.path.join(pictures_dir, f"t{n:05d}-{j}.png")
                        with open(path, "wb") as f:
                            f.write(_noise_png(rng, rng.randint(*shape.width), rng.randint(*shape.height)))
                        paths.append(path)
                    prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*shape.words)))
                    spec = {"images": paths, "prompt": prompt, "max_new_tokens": rng.randint(*shape.tokens)}
                    task_id = f"rt{n:05d}"
                    if self._uplink(ground, task_id, paths, prompt, spec["max_new_tokens"], report):
                        specs[task_id] = spec
                    n += 1
                    while not stop.is_set() and len(specs) - len(results) >= self.outstanding:
                        self._collect(ground, specs, results, wait_s=2.0)

        ground_thread = threading.Thread(target=ground_loop, name="campaign-ground", daemon=True)
        ground_thread.start()

        last_progress = 0
        stopped = False
        try:
            self._started(report)
            while True:
                time.sleep(1.0)
                self._observe(self.log.read())
                cuts = self.log.trace_cuts
                if (cuts >= self.kills or self._trace_position() >= self.settle_start) and self._faults_done():
                    break
                if bus.poll() is not None:
                    raise RuntimeError(f"campaign bus exited by itself ({bus.returncode})")
                if report.bus_kills < self.bus_kills_planned and cuts >= (report.bus_kills + 1) * self.bus_kill_every:
                    time.sleep(self.rng.uniform(0.0, 3.0))  # a random instant of the next window
                    self._kill_bus(bus)
                    report.bus_kills += 1
                    self._observe(self.log.read())
                    bus = self._start_bus(self._trace_position())
                if cuts - last_progress >= 25:
                    last_progress = cuts
                    report.payload_kills = cuts  # so far (a partial report is written before the log is analysed)
                    self.say(
                        f"[redteam] {cuts}/{self.kills} payload cuts, {report.bus_kills} bus kills, "
                        f"{len(specs)} tasks uplinked, {time.monotonic() - started:.0f} s"
                    )
                    self._write(report, specs, results, time.monotonic() - started, partial=True)
            self.say("[redteam] cuts done; power stays on: waiting for every task to finish")
            bus = self._settle(bus)
            stop.set()
            ground_thread.join(600)
            with GroundClient(
                self.keys,
                GroundOptions(
                    endpoints=self.endpoints,
                    timeout_s=60.0,
                    retries=100,
                    notify=lambda s: None,
                    state_dir=os.path.join(self.out, "ground"),
                ),
            ) as ground:
                deadline = time.monotonic() + 1800
                while len(results) < len(specs) and time.monotonic() < deadline:
                    self._collect(ground, specs, results, wait_s=5.0)
            stopped = True
            self._stopping(report)
        finally:
            stop.set()
            self.log.close()
            if not stopped:
                self._stopping(report)
            if bus.poll() is None:
                bus.send_signal(signal.SIGTERM)
                try:
                    bus.wait(60)
                except Exception:  # noqa: BLE001
                    os.killpg(bus.pid, signal.SIGKILL)
        self._verify(report, specs, results, log_path)
        report.wall_s = time.monotonic() - started
        self._write(report, specs, results, report.wall_s, partial=False)
        return report

    def _collect(self, ground, specs, results, wait_s: float) -> None:
        for task_id in [t for t in list(specs) if t not in results]:
            try:
                results[task_id] = ground.result(task_id)
            except CommandRejected as exc:
                if exc.code != ResponseCode.RESULT_NOT_READY:
                    results[task_id] = exc  # finished without an answer: counted as lost below
            except GroundError:
                return
        time.sleep(wait_s)

    # -- the verdict ----------------------------------------------------------------------------------
    def _verify(self, report: CampaignReport, specs: dict, results: dict, log_path: str) -> None:
        entries = bl.read_log(log_path)
        report.tasks = len(specs)
        references = self._references(specs)
        for task_id in sorted(specs):
            got = results.get(task_id)
            if not isinstance(got, m.TaskResult):
                report.lost.append(f"{task_id}: {got if got is not None else 'no result'}")
                continue
            report.completed += 1
            want = references.get(task_id)
            if want is not None and (list(got.token_ids) != want[0] or got.logits_sha256.hex() != want[1]):
                report.answered_wrong.append(task_id)
        completions = Counter(
            e.data.get("task_id")
            for e in entries
            if e.kind == bl.PAYLOAD_REPORT and e.data.get("event") == "TASK_COMPLETED"
        )
        report.run_twice = sorted(t for t, n in completions.items() if n > 1)
        report.payload_exits = sum(1 for e in entries if e.kind == bl.PAYLOAD_EXITED)
        report.fdir_cycles = sum(1 for e in entries if e.kind == bl.FDIR_ACTION)
        report.quarantined = sorted(
            {
                e.data.get("text", "")[:80]
                for e in entries
                if e.kind == bl.PAYLOAD_REPORT and e.data.get("event") == "ITEM_QUARANTINED"
            }
        )
        report.crash_loops = report.payload_exits + len(report.quarantined) + report.fdir_cycles
        report.journal_damage_events = sum(
            1
            for e in entries
            if e.kind == bl.PAYLOAD_REPORT and e.data.get("event") in ("JOURNAL_CORRUPT", "TASKS_LOST")
        )
        report.payload_kills = sum(
            1 for e in entries if e.kind == bl.POWER_OFF and e.data.get("origin") == "trace" and e.data.get("was_on")
        )
        report.kills_by_activity = dict(self._activities(entries).most_common())

    @staticmethod
    def _activities(entries) -> Counter:
        """What the payload was doing at each cut, as far as the bus saw it."""

        counts: Counter[str] = Counter()
        in_flight: set[object] = set()  # store ids of uplinks the bus forwarded, not yet confirmed
        state = "booting"
        for e in entries:
            kind, d = e.kind, e.data
            if kind == bl.POWER_ON:
                state, in_flight = "booting", set()
            elif kind == bl.PAYLOAD_CONNECTED:
                state = "idle"
            elif kind == bl.COMMAND_FORWARDED:
                in_flight.add(d.get("store_id"))
            elif kind == bl.COMMAND_CONFIRMED:
                in_flight.discard(d.get("store_id"))
            elif kind == bl.PAYLOAD_REPORT and d.get("type") == "PROGRESS":
                state = f"task {d.get('phase')}"
            elif kind == bl.PAYLOAD_REPORT and d.get("type") in ("COMPLETED", "FAILED") and d.get("task_id"):
                state = "result report"
            elif kind == bl.PAYLOAD_REPORT and d.get("type") == "STARTED":
                state = "task start"
            elif kind == bl.POWER_OFF and d.get("origin") == "trace" and d.get("was_on"):
                counts[state if not in_flight or state == "booting" else f"{state} + uplink"] += 1
        return counts

    def _references(self, specs: dict) -> dict:
        # lazy: torch/transformers (seconds), only when the engine runs; the bus and `ow --help` never do
        from flight.engine import Engine, EngineOptions
        from flight.model.inputs import inputs_from_files
        from flight.model.loader import load_model

        model = load_model(self.model, device="cpu")
        out = {}
        for task_id, spec in sorted(specs.items()):
            inputs = inputs_from_files(model, spec["images"], spec["prompt"])
            with tempfile.TemporaryDirectory() as scratch:
                result = Engine(model, EngineOptions(geometry=Geometry(16, 2, 2, 1), policy="none", threads=1)).run(
                    inputs, scratch, spec["max_new_tokens"]
                )
            out[task_id] = (list(result.token_ids), result.logits_sha256())
        return out

    def _write(self, report: CampaignReport, specs, results, wall_s: float, partial: bool) -> None:
        data = asdict(report)
        data.update(
            passed=report.passed,
            partial=partial,
            wall_s=round(wall_s, 1),
            kills_planned=self.kills,
            tasks_uplinked=len(specs),
            results_in=len(results),
        )
        with open(os.path.join(self.out, "campaign-report.json"), "w") as f:
            json.dump(data, f, indent=2, default=str)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "bus-worker":
        raise SystemExit(bus_worker(sys.argv[2]))
    raise SystemExit("usage: python -m hil.redteam bus-worker SPEC (the campaign's bus; see bench/redteam.py)")
