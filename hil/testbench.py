"""The hardware-in-the-loop testbench: real bus, real payload process, real ground link, a trace.

    Testbench(BenchConfig(trace="trace-a", policy="orbitweaver", model=DIR, out_dir=DIR, requests=3)).run()

1. computes each request's uninterrupted reference in-process (tokens, logits hash);
2. chooses the pace and time scale (`time_scale="auto"`: one uninterrupted request, boot included,
   lasts `trace.reference_request_s` trace seconds -- the paper's three-minute missions);
3. starts `ow bus run` on the trace (which spawns and SIGKILLs `ow flight run`), follows the
   telemetry link, uplinks the workload through the ground client and waits for every result;
4. measures per request: end-to-end time, cuts suffered, recovery latency (power-up -> first
   useful compute), work lost, bytes written, energy (docs/hil.md power model), and checks every
   output against its reference, bit for bit.

A report (JSON) and a readable summary land in `out_dir`. Everything is real: processes, SIGKILL,
ZeroMQ with CurveZMQ on loopback (or on the configured TCP addresses of a bench).
"""

from __future__ import annotations

import bisect
import json
import json as _json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import traces
from common.wire import messages as m
from common.wire.link import Endpoints, init_keys
from flight.checkpoint.policies import Geometry
from flight.events import EngineEvent
from flight.options import resolve_cadence
from flight.recovery.cost import MODELS, ORIN_AGX_NVME, REFERENCE_CHUNK, CostModel
from ground.client import GroundClient, GroundOptions
from ground.errors import GroundError
from hil.bus import BusConfig, BusProcess
from hil.bus import buslog as bl

SAMPLES = Path(__file__).resolve().parent / "samples"
PROMPTS = [
    "count the ships near the coast and describe the harbor",
    "describe the clouds and report what is visible below them",
    "compare the two scenes and list any new damage to roads or fields",
    "identify the coastline and estimate the area of the sand",
    "report any fire smoke or flood in these images",
]
UNIT_ORDER = {"vision": 0, "prefill": 1, "decode": 2}
#: A request's `failure` when the payload simply did not finish it within the trace (every other
#: failure says what stopped it: the payload's FAILED report, the uplink, the bus, the downlink)
NOT_FINISHED = "not finished when the trace ended"
STOPPED_BY_LIMIT = "not finished when the run's wall-clock limit stopped it, before the trace ended"


@dataclass(frozen=True)
class RequestSpec:
    images: tuple[str, ...]
    prompt: str
    max_new_tokens: int = 24


def default_workload(n: int, max_new_tokens: int = 24) -> list[RequestSpec]:
    samples = sorted(str(p) for p in SAMPLES.glob("*.png"))
    return [
        RequestSpec(
            (samples[i % len(samples)], samples[(i + 1) % len(samples)]), PROMPTS[i % len(PROMPTS)], max_new_tokens
        )
        for i in range(n)
    ]


@dataclass
class PowerModel:
    """Payload power by state (docs/hil.md). Defaults: a Jetson AGX Orin module in its 30 W mode
    running inference, idling when on without work, NVMe write power while checkpointing."""

    compute_w: float = 30.0
    idle_w: float = 9.0
    boot_w: float = 15.0
    ssd_write_w: float = 3.5
    ssd_write_bytes_per_s: float = 1.5e9


#: The target payload's boot, power-on to the flight process ready to compute, in trace seconds
#: (docs/hil.md "Boot"): 12 s from cold power-on to the log-in prompt for Jetson Linux in its
#: default configuration (NVIDIA Jetson Linux Developer Guide r35, "Boot Time Optimization"; about
#: 3 s once optimised), plus 3 s for the flight process's interpreter and library imports on the
#: Orin's CPU (assumed; bench/cold_start.py measures this machine's).
TARGET_BOOT_TRACE_S = 15.0


@dataclass
class BenchConfig:
    trace: str
    model: str
    out_dir: str
    policy: str = "orbitweaver"
    requests: int = 3
    workload: list[RequestSpec] | None = None
    time_scale: float | str = "auto"  # wall seconds per trace second, or "auto"
    #: target uninterrupted request length in wall seconds (auto pace): the compute alone with an
    #: emulated boot; boot included with the real one (boot_trace_s None)
    request_seconds: float = 20.0
    #: emulated target boot in trace seconds: each payload is forked from a pre-loaded zygote and
    #: waits this long (scaled like the compute) after power-on; None: exec it and pay this
    #: machine's real start-up inside the window (docs/hil.md)
    boot_trace_s: float | None = TARGET_BOOT_TRACE_S
    pace_ms: float | None = None  # per-unit pace of the payload; None: from request_seconds
    chunk: int = 16
    group: int = 2
    decode_every: int = 4
    vision_every: int = 1
    planner: str = "optimal"  # every comparison runs OrbitWeaver with its own planner
    #: orbitweaver's checkpoint cadence: "fixed" (the paper's) or "adaptive" (docs/engine.md);
    #: None: the policy's default (flight.options.default_cadence)
    cadence: str | None = None
    threads: int = 1
    start_at_s: float = 0.0
    timeout_s: float | None = None  # wall; default: until the trace ends (bus clock)
    power: PowerModel = field(default_factory=PowerModel)
    endpoints: Endpoints | None = None  # default: ephemeral loopback ports
    extra_flight_args: tuple[str, ...] = ()
    #: jump the bus clock over spans where nothing can happen (payload off until its next power-on):
    #: the trace's off time costs no wall time; times are reported in trace seconds either way
    skip_idle: bool = True
    #: throttle the payload's checkpoint storage so that reading/writing a layer-chunk of KV takes,
    #: relative to computing it (the pace), what it takes on a Jetson AGX Orin with NVMe running
    #: Qwen3-VL-2B. Weight reads stay native: they cost every policy the same at each boot, and a
    #: tiny model has far fewer layer-chunks per request than an 8K-token request on a 2B model,
    #: so throttled weights would swamp what the policies differ in.
    emulate_target_storage: bool = False


@dataclass
class RequestReport:
    task_id: str
    prompt: str
    images: list[str]
    completed: bool
    correct: bool | None
    e2e_s: float | None
    e2e_trace_s: float | None
    cuts: int
    recovery_latency_s: list[float]
    work_lost_units: list[int]
    energy_j: float | None
    tokens: int
    failure: str | None = None


@dataclass
class BenchReport:
    trace: str
    policy: str
    time_scale: float
    pace_ms: float
    boot_s: float
    requests: list[RequestReport]
    power_cycles: int
    cuts_total: int
    bytes_written: int
    energy_j: float
    wall_s: float
    completion_rate: float
    all_correct: bool
    notes: list[str] = field(default_factory=list)
    #: emulated boot (trace s), or None for this machine's real start-up
    boot_trace_s: float | None = None
    #: median wall seconds from power-on to the payload's first heartbeat, and what of it came
    #: after the emulated boot (real start-up work of the flight process on this machine)
    connect_s: float | None = None
    start_residual_s: float | None = None
    #: the checkpoint cadence the payload flew (None in reports written before it was recorded)
    cadence: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> BenchReport:
        """The report `to_json` wrote (a run's report.json)."""
        fields_ = dict(data)
        fields_["requests"] = [RequestReport(**r) for r in fields_["requests"]]
        return cls(**fields_)

    def _outputs(self) -> str:
        if not any(r.completed for r in self.requests):
            return "none to check (nothing completed)"
        return "all bitwise equal to the references" if self.all_correct else "MISMATCH"

    def summary(self) -> str:
        boot = (
            f"emulated boot {self.boot_trace_s:g} trace s ({self.boot_s:.2f} s)"
            if self.boot_trace_s is not None
            else f"real boot {self.boot_s:.1f} s"
        )
        if self.start_residual_s is not None:
            boot += (
                f", then {self.start_residual_s:.2f} s real start-up "
                f"({self.start_residual_s / self.time_scale:.1f} trace s) to the first heartbeat"
            )
        lines = [
            f"trace {self.trace}  policy {self.policy}"
            + (f"  cadence {self.cadence}" if self.cadence else "")
            + f"  scale {self.time_scale:.4g} wall s per trace s  "
            f"pace {self.pace_ms:.0f} ms/unit  {boot}",
            f"  {sum(r.completed for r in self.requests)}/{len(self.requests)} completed "
            f"({self.completion_rate:.0%}), outputs {self._outputs()}; "
            f"{self.cuts_total} cuts, {self.power_cycles} power-ups, {self.bytes_written / 2**20:.1f} MiB written, "
            f"{self.energy_j:.0f} J, {self.wall_s:.0f} s wall",
        ]
        for r in self.requests:
            rec = ", ".join(f"{x:.1f}" for x in r.recovery_latency_s) or "-"
            lines.append(
                f"  {r.task_id}: {'done' if r.completed else 'NOT DONE'}"
                f"{'' if r.correct in (None, True) else ' WRONG OUTPUT'}  e2e "
                f"{'-' if r.e2e_s is None else f'{r.e2e_s:.1f} s ({r.e2e_trace_s:.0f} trace s)'}  "
                f"cuts {r.cuts}  recovery {rec} s  lost {sum(r.work_lost_units)} units"
            )
        return "\n".join(lines)


_BOOT_SECONDS: list[float] = []
_REFERENCES: dict = {}
# Campaigns that run at once in one process (make bench's two end-to-end parts) ask for the same
# references: one computes, the other waits for it.
_REFERENCES_LOCK = threading.Lock()


NVME_WRITE_BYTES_PER_S = 2.0e9  # sustained write of a Gen3 x4 class NVMe drive with fsync batches


def target_storage_mbps(model_dir: str, chunk: int, pace_ms: float) -> tuple[float, float]:
    """(read MB/s, write MB/s) that give the paced payload the Orin's storage-to-compute ratio.

    On the target, reading one layer's KV for a 1,024-token chunk of Qwen3-VL-2B takes r times as
    long as computing that layer on that chunk (flight/recovery/cost.py: Orin numbers). Here a
    layer-chunk is paced to `pace_ms`, so its KV bytes must move in r x pace."""

    target = CostModel.for_target(MODELS["qwen3-vl-2b"], ORIN_AGX_NVME)
    dims = MODELS["qwen3-vl-2b"]
    kv_target = dims.kv_bytes_per_token_layer * REFERENCE_CHUNK
    compute = target.compute_s(1, REFERENCE_CHUNK, REFERENCE_CHUNK)
    read_ratio = kv_target / ORIN_AGX_NVME.read_bytes_per_s / compute
    write_ratio = kv_target / NVME_WRITE_BYTES_PER_S / compute
    with open(os.path.join(model_dir, "config.json")) as f:
        text = _json.load(f)["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    dtype_bytes = 2 if str(text.get("dtype", "float32")) in ("bfloat16", "float16") else 4
    kv_here = 2 * text["num_key_value_heads"] * head_dim * dtype_bytes * chunk
    pace_s = pace_ms / 1000.0
    return kv_here / (read_ratio * pace_s) / 1e6, kv_here / (write_ratio * pace_s) / 1e6


def target_data_weight(model_dir: str) -> float:
    """Device bytes per byte for the payload's own data (task inputs, images) beside the
    checkpoint records that `target_storage_mbps` sets the bandwidths for.

    A paced layer-chunk of the small model stands for a layer on a 1,024-token chunk of
    Qwen3-VL-2B, so each byte of its KV stands for kv(2B) / kv(here) target bytes per token and
    layer. A task's inputs and images are not smaller here: per visual token they hold the same
    pixel patches as on the target, and the request's tokens stand for REFERENCE_CHUNK / chunk
    times as many there. Charged like checkpoint bytes they would move kv(2B)/kv(here) per token
    times too slowly (for the small model 16 x: a request's 12.6 MB of inputs took 43 s to write
    where its target takes a sixteenth); charged at this weight, every byte the payload moves
    takes its target time, stretched as the compute is."""
    with open(os.path.join(model_dir, "config.json")) as f:
        text = _json.load(f)["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    dtype_bytes = 2 if str(text.get("dtype", "float32")) in ("bfloat16", "float16") else 4
    here_per_token_layer = 2 * text["num_key_value_heads"] * head_dim * dtype_bytes
    return min(1.0, here_per_token_layer / MODELS["qwen3-vl-2b"].kv_bytes_per_token_layer)


def measure_boot_seconds() -> float:
    """How long a payload process takes from exec to ready to compute (interpreter + imports);
    measured once per process."""
    if _BOOT_SECONDS:
        return _BOOT_SECONDS[0]
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import flight.runtime.app, flight.engine, flight.model.loader"],
        check=True,
        capture_output=True,
    )
    _BOOT_SECONDS.append(time.perf_counter() - start)
    return _BOOT_SECONDS[0]


def reference_run(model_dir: str, spec: RequestSpec, cfg: BenchConfig, scratch: str) -> dict:
    """The uninterrupted answer for `spec`, computed in this process (no checkpoints); cached per
    model, request and geometry for the life of the process."""
    key = (os.path.abspath(model_dir), spec, cfg.chunk, cfg.group, cfg.decode_every, cfg.vision_every, cfg.threads)
    with _REFERENCES_LOCK:
        if key not in _REFERENCES:
            _REFERENCES[key] = _reference_run(model_dir, spec, cfg, scratch)
        return dict(_REFERENCES[key])


def _reference_run(model_dir: str, spec: RequestSpec, cfg: BenchConfig, scratch: str) -> dict:
    # lazy: torch/transformers (seconds), only when the engine runs; the bus and `ow --help` never do
    from flight.engine import Engine, EngineOptions
    from flight.model.inputs import inputs_from_files
    from flight.model.loader import load_model

    model = load_model(model_dir, device="cpu")
    inputs = inputs_from_files(model, list(spec.images), spec.prompt)
    units = {"n": 0}
    geometry = Geometry(cfg.chunk, cfg.group, cfg.decode_every, cfg.vision_every)
    groups = geometry.layer_groups(model.adapter.num_layers)

    def count(event: EngineEvent, **fields: Any) -> None:
        # Paced units, as the engine's pacer counts them: a prefill block of G layers is G units.
        if event == EngineEvent.PREFILL_BLOCK_DONE:
            l0, l1 = groups[fields["group"]]
            units["n"] += l1 - l0
        elif event in (EngineEvent.VISION_BLOCK_DONE, EngineEvent.DECODE_STEP_DONE):
            units["n"] += 1

    result = Engine(model, EngineOptions(geometry=geometry, policy="none", threads=cfg.threads), events=count).run(
        inputs, scratch, spec.max_new_tokens
    )
    return {"token_ids": result.token_ids, "logits_sha256": result.logits_sha256(), "units": units["n"]}


class _TelemetryRecorder(threading.Thread):
    """Follows the telemetry link for the whole run: every packet, stamped with the wall clock."""

    def __init__(self, keys_dir: str, endpoints: Endpoints, on_packet=None):
        super().__init__(name="telemetry-recorder", daemon=True)

        self.client = GroundClient(
            keys_dir,
            GroundOptions(
                endpoints=endpoints,
                commands=False,
                station="ground",
                state_dir=os.path.join(keys_dir, "state-recorder"),
                progress=False,
            ),
        )
        self.packets: list[tuple[float, m.Message]] = []
        self.stop_flag = threading.Event()
        self.on_packet = on_packet
        self.lock = threading.Lock()
        self.finals: dict[str, m.Message] = {}  # task id -> its COMPLETED (of the uplink) or FAILED
        self.results: dict[str, m.TaskResult] = {}  # task id -> the TASK_RESULT the payload sent

    def run(self):
        with self.client:
            while not self.stop_flag.is_set():
                for t in self.client.telemetry(0.5):
                    msg = t.message
                    with self.lock:
                        self.packets.append((time.time(), msg))
                        task_id = getattr(msg, "task_id", None)
                        if isinstance(msg, m.TaskResult):
                            self.results.setdefault(task_id, msg)
                        elif task_id is not None and (
                            isinstance(msg, m.Failed) or (isinstance(msg, m.Completed) and msg.tc_type == 0x0110)
                        ):
                            self.finals.setdefault(task_id, msg)
                    if self.on_packet:
                        self.on_packet(msg)

    def final(self, task_id: str):
        with self.lock:
            return self.finals.get(task_id), self.results.get(task_id)

    def snapshot(self) -> list[tuple[float, m.Message]]:
        with self.lock:
            return list(self.packets)


@dataclass(frozen=True)
class BenchSetup:
    """Where a run runs when it is not this machine's own loopback bench (a bench of a bench
    farm, hil/farm.py): the files its configuration names (model directory, trace, request
    images) as this host holds them, and the bench's power switch as `BusConfig` fields
    (power_driver, ssh_host, ...; docs/hil.md "Bench farm"). The configuration itself is left as
    it is: it says what runs, and its report names the trace as the campaign does."""

    #: a path or name of the configuration -> where this host holds that file or directory
    files: dict[str, str] = field(default_factory=dict)
    #: BusConfig fields of the bench's power switch
    switch: dict[str, Any] = field(default_factory=dict)
    #: where the bus binds the payload link (default: loopback, an ephemeral port); a board on the
    #: bench's network reaches it there
    payload_bind: str | None = None
    #: the run's bus dies with the thread that runs it (a farm's worker may be killed under it)
    bus_dies_with_run: bool = False

    def local(self, path: str) -> str:
        return self.files.get(path, path)


#: in a run's output directory: the bus's data dir, which holds the payload's (hil/bus/config.py)
RUN_STATE_DIR = "bus"


class EarlierRunError(FileExistsError):
    """The output directory already holds a run: a new one there would not start from nothing."""


class Testbench:
    def __init__(self, cfg: BenchConfig, say=None, on_clock_started=None, setup: BenchSetup | None = None):
        """`on_clock_started` (optional) is called once the bus is ready and its trace clock
        starts, or when the run ends without getting there (a campaign starts its next run then).
        `setup`: a bench farm's bench (its files and its power switch); default this machine's."""
        self.cfg = cfg
        self.setup = setup or BenchSetup()
        self.model = self.setup.local(cfg.model)
        self.say = say or (lambda line: print(line, flush=True))
        self._on_clock_started = on_clock_started
        self.out = Path(cfg.out_dir)

    # ---- set-up -----------------------------------------------------------------------------------
    def _prepare(self):
        cfg = self.cfg
        if (self.out / RUN_STATE_DIR).exists():
            # The bus's and the payload's state of an earlier run (queue journal, checkpoints, bus
            # log): a run started on top of it would resume that run's tasks and append to its log.
            raise EarlierRunError(
                f"{self.out} holds an earlier run ({RUN_STATE_DIR}/): choose another output directory or remove it"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        self.keys = str(self.out / "keys")
        init_keys(self.keys)
        self.trace = traces.load(self.setup.local(cfg.trace))
        self.start_at = cfg.start_at_s
        if self.start_at == 0 and not self.trace.is_on_at(0):
            # Nothing can happen before the first window: start there rather than wait for it.
            self.start_at = next((w.start_s for w in self.trace.windows()), 0.0)
        self.workload = cfg.workload or default_workload(cfg.requests)
        refs_path = self.out / "references.json"
        self.references = []
        for i, spec in enumerate(self.workload):
            self.references.append(
                reference_run(self.model, self._local_spec(spec), cfg, str(self.out / "reference" / f"r{i}"))
            )
        refs_path.write_text(json.dumps(self.references))
        units = statistics.mean(r["units"] for r in self.references)
        emulated = cfg.boot_trace_s is not None
        real_boot = 0.0 if emulated else measure_boot_seconds()
        if cfg.pace_ms is not None:
            self.pace_ms = cfg.pace_ms
        else:
            self.pace_ms = max(1.0, (cfg.request_seconds - real_boot) * 1000.0 / units)
        # With the real boot, the boot is part of the request mapped onto the reference request;
        # an emulated boot is the target's own, outside the request's compute, like on orbit.
        request_wall = real_boot + units * self.pace_ms / 1000.0
        self.request_wall = request_wall
        self.scale = (
            request_wall / self.trace.reference_request_s if cfg.time_scale == "auto" else float(cfg.time_scale)
        )
        self.boot_s = cfg.boot_trace_s * self.scale if emulated else real_boot

    def _flight_args(self) -> list[str]:
        c = self.cfg
        args = [
            "--policy",
            c.policy,
            "--chunk",
            str(c.chunk),
            "--group",
            str(c.group),
            "--decode-every",
            str(c.decode_every),
            "--vision-every",
            str(c.vision_every),
            "--planner",
            c.planner,
            "--threads",
            str(c.threads),
            "--pace-ms",
            f"{self.pace_ms:.3f}",
            "--device",
            "cpu",
        ]
        # Always named on the payload's command line, the default included: a run's record
        # says which cadence flew without knowing what the default was when it ran.
        args += ["--cadence", resolve_cadence(c.policy, c.cadence)]
        if c.emulate_target_storage:
            read, write = target_storage_mbps(self.model, c.chunk, self.pace_ms)
            args += ["--emulate-read-mbps", f"{read:.6f}", "--emulate-write-mbps", f"{write:.6f}"]
            args += ["--emulate-data-weight", f"{target_data_weight(self.model):.6f}"]
        return args + list(c.extra_flight_args)

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> BenchReport:
        try:
            return self._run()
        finally:
            self._clock_started()  # a run that failed to start still lets the next one start

    def _clock_started(self) -> None:
        callback, self._on_clock_started = self._on_clock_started, None
        if callback is not None:
            callback()

    def _run(self) -> BenchReport:
        cfg = self.cfg
        self._prepare()
        boot = (
            f"emulated boot {cfg.boot_trace_s:g} trace s = {self.boot_s:.2f} s"
            if cfg.boot_trace_s is not None
            else f"real payload boot {self.boot_s:.1f} s"
        )
        self.say(
            f"[bench] trace {cfg.trace} ({self.trace.duration_s:.0f} trace s), policy {cfg.policy}, "
            f"{len(self.workload)} requests; time scale {self.scale:.4g} wall s per trace s, pace "
            f"{self.pace_ms:.0f} ms/unit, {boot}"
        )
        endpoints = cfg.endpoints or Endpoints(
            commands="tcp://127.0.0.1:*",
            payload=self.setup.payload_bind or "tcp://127.0.0.1:*",
            telemetry="tcp://127.0.0.1:*",
        )
        bus_cfg = BusConfig(
            trace=str(self._trace_path()),
            data_dir=str(self.out / RUN_STATE_DIR),
            keys_dir=self.keys,
            time_scale=self.scale,
            start_at_s=self.start_at,
            endpoints=endpoints,
            model=self.model,
            flight_args=self._flight_args(),
            heartbeat_timeout_s=max(20.0, 4 * self.boot_s),
            boot_timeout_s=max(60.0, 10 * self.boot_s),
            boot_trace_s=cfg.boot_trace_s,
            skip_idle=cfg.skip_idle,
        )
        if self.setup.switch:  # a bench farm's bench: its own power switch
            bus_cfg = replace(bus_cfg, **self.setup.switch)
        started = time.time()
        bus = BusProcess(
            bus_cfg, die_with_parent=self.setup.bus_dies_with_run
        ).start()  # returns once the zygote is ready: the trace clock starts
        self._clock_started()
        bus_proc = bus.proc
        assert bus_proc is not None  # start() has launched it
        self.log_tail = _LogTail(self.out / RUN_STATE_DIR / bl.LOG_FILE)
        recorder = _TelemetryRecorder(self.keys, bus.endpoints, on_packet=self._show)
        recorder.start()
        tasks: list[tuple[str, float | None]] = []
        failures: dict[str, str] = {}
        try:
            with GroundClient(
                self.keys,
                GroundOptions(
                    endpoints=bus.endpoints,
                    timeout_s=max(30.0, 6 * self.boot_s),
                    retries=50,
                    progress=False,
                    notify=lambda s: None,
                ),
            ) as ground:
                for i, spec in enumerate(self.workload):
                    task_id = f"r{i:02d}"
                    try:
                        ground.uplink(
                            [self.setup.local(x) for x in spec.images],
                            spec.prompt,
                            max_new_tokens=spec.max_new_tokens,
                            task_id=task_id,
                        )
                        tasks.append((task_id, time.time()))
                        self.say(f"[ground] uplinked {task_id}: {spec.prompt!r} with {len(spec.images)} images")
                    except GroundError as exc:
                        tasks.append((task_id, None))
                        failures[task_id] = f"uplink: {exc}"
                        self.say(f"[ground] uplink of {task_id} failed: {exc}")
                results = self._wait_for_results(
                    ground, tasks, recorder, failures, started, bus_alive=lambda: bus_proc.poll() is None
                )
        finally:
            time.sleep(0.5)
            recorder.stop_flag.set()
            bus.stop()
            recorder.join(timeout=10)
        wall = time.time() - started
        report = self._analyse(tasks, results, failures, recorder.snapshot(), wall)
        (self.out / "report.json").write_text(json.dumps(report.to_json(), indent=2))
        (self.out / "summary.txt").write_text(report.summary() + "\n")
        return report

    def _wait_for_results(self, ground, tasks, recorder, failures, started, bus_alive=lambda: True) -> dict:
        """Until every task has ended or the trace has (a request finishing in the open window
        after the trace does not count): results as the payload sent them, else downlinked."""

        cfg = self.cfg
        deadline = started + cfg.timeout_s if cfg.timeout_s else None
        pending = [task_id for task_id, queued_at in tasks if queued_at is not None]
        results = {}
        while pending:
            for task_id in list(pending):
                final, result = recorder.final(task_id)
                if final is None:
                    continue
                pending.remove(task_id)
                if isinstance(final, m.Failed):
                    failures[task_id] = f"failed: {final.code.name}: {final.reason}"
                    continue
                if result is None:
                    try:
                        result = ground.result(task_id, wait=True, max_wait_s=120.0, poll_s=5.0)
                    except GroundError as exc:
                        failures[task_id] = f"result: {exc}"
                        continue
                results[task_id] = result
            if not pending:
                break
            ended = self.log_tail.trace_ended()
            if ended or (deadline is not None and time.time() > deadline):
                for task_id in pending:
                    failures[task_id] = NOT_FINISHED if ended else STOPPED_BY_LIMIT
                break
            if not bus_alive():
                for task_id in pending:
                    failures[task_id] = "the bus stopped (see bus/bus-stderr.log)"
                break
            time.sleep(0.25)
        return results

    def _trace_path(self) -> Path:
        return Path(traces.resolve(self.setup.local(self.cfg.trace)))

    def _local_spec(self, spec: RequestSpec) -> RequestSpec:
        """The request with its images as this host holds them (the same pictures)."""
        return replace(spec, images=tuple(self.setup.local(x) for x in spec.images))

    def _show(self, msg: m.Message) -> None:
        if isinstance(msg, m.PowerStateChange):
            self.say(f"[bus] payload power {'ON' if msg.payload_on else 'OFF'} ({msg.cause})")
        elif isinstance(msg, m.ShutdownWarning):
            self.say(f"[bus] shutdown warning: cut in {msg.lead_time_s:.1f} s ({msg.cause})")
        elif isinstance(msg, m.Event) and msg.event_id.name in (
            "BOOT",
            "TASK_STARTED",
            "TASK_RESUMED",
            "RECOVERY_PLANNED",
            "TASK_COMPLETED",
            "TASK_FAILED",
            "CHECKPOINT_CORRUPT",
            "CHECKPOINT_MANIFEST_MISMATCH",
            "DISK_FULL",
        ):
            self.say(f"[payload] {msg.text}")

    # ---- analysis ---------------------------------------------------------------------------------------
    def _analyse(self, tasks, results, failures, packets, wall) -> BenchReport:
        entries = bl.read_log(self.out / RUN_STATE_DIR / bl.LOG_FILE)
        to_trace = _trace_clock(entries, self.scale, self.start_at)
        ons = [e.utc for e in entries if e.kind == bl.POWER_ON]
        offs = [e for e in entries if e.kind == bl.POWER_OFF]
        bytes_written = sum(int(e.data.get("payload_write_bytes") or 0) for e in offs)
        cuts_total = sum(1 for e in offs if e.data.get("origin") in ("trace", "fdir"))
        intervals = _on_intervals(entries)
        reports = []
        busy_total = 0.0
        for i, (task_id, queued_at) in enumerate(tasks):
            spec, ref = self.workload[i], self.references[i]
            res = results.get(task_id)
            mine = [(t, msg) for t, msg in packets if getattr(msg, "task_id", None) == task_id]
            completed_at = next((t for t, msg in mine if isinstance(msg, m.Completed) and msg.tc_type == 0x0110), None)
            correct = None
            if res is not None:
                correct = (
                    list(res.token_ids) == ref["token_ids"] and bytes(res.logits_sha256).hex() == ref["logits_sha256"]
                )
            starts = [t for t, msg in mine if isinstance(msg, m.Started)]
            progress = [(t, msg) for t, msg in mine if isinstance(msg, m.Progress)]
            totals: dict[str, int] = {}
            for _, p in progress:
                totals[str(p.phase)] = max(totals.get(str(p.phase), 0), int(p.total))
            recovery, lost = [], []
            for k, start in enumerate(starts[1:], 1):
                power_on = max((t for t in ons if t <= start), default=None)
                first = next((t for t, p in progress if t > start), None)
                if power_on is not None and first is not None:
                    recovery.append(first - power_on)
                before = [p for t, p in progress if starts[k - 1] < t < start]
                after = [p for t, p in progress if t > start]
                if before and after:
                    lost.append(max(0, _unit_index(before[-1], totals) - (_unit_index(after[0], totals) - 1)))
            busy = _busy_seconds(starts, completed_at, intervals)
            busy_total += busy
            energy = busy * self.cfg.power.compute_w if res is not None else None
            e2e = (completed_at - queued_at) if (completed_at and queued_at) else None
            # In trace seconds, from the later of the uplink and the trace's start (the bus
            # stores commands while the clock has not started) to COMPLETED; skipped spans count.
            e2e_trace = (to_trace(completed_at) - to_trace(queued_at)) if e2e is not None else None
            reports.append(
                RequestReport(
                    task_id,
                    spec.prompt,
                    [os.path.basename(x) for x in spec.images],
                    res is not None,
                    correct,
                    e2e,
                    e2e_trace,
                    int(res.interruptions) if res is not None else max(0, len(starts) - 1),
                    recovery,
                    lost,
                    energy,
                    len(res.token_ids) if res is not None else 0,
                    failures.get(task_id),
                )
            )
        power = self.cfg.power
        on_time = sum(b - a for a, b in intervals)
        boot_time = len(ons) * self.boot_s
        energy_total = (
            busy_total * power.compute_w
            + max(0.0, on_time - busy_total - boot_time) * power.idle_w
            + boot_time * power.boot_w
            + bytes_written / power.ssd_write_bytes_per_s * power.ssd_write_w
        )
        done = [r for r in reports if r.completed]
        connects = [
            float(e.data["after_power_on_s"])
            for e in entries
            if e.kind == bl.PAYLOAD_CONNECTED and e.data.get("after_power_on_s") is not None
        ]
        connect = statistics.median(connects) if connects else None
        residual = None
        if connect is not None and self.cfg.boot_trace_s is not None:
            residual = max(0.0, connect - self.boot_s)
        return BenchReport(
            self.cfg.trace,
            self.cfg.policy,
            self.scale,
            self.pace_ms,
            self.boot_s,
            reports,
            len(ons),
            cuts_total,
            bytes_written,
            energy_total,
            wall,
            len(done) / max(1, len(reports)),
            all(r.correct for r in done) and bool(done),
            boot_trace_s=self.cfg.boot_trace_s,
            connect_s=connect,
            start_residual_s=residual,
            cadence=resolve_cadence(self.cfg.policy, self.cfg.cadence),
        )


class _LogTail:
    """Reads a bus run log as it grows (across its rotations); says when the trace has ended."""

    def __init__(self, path: Path):
        self.follower, self.ended = bl.LogFollower(path), False

    def trace_ended(self) -> bool:
        if not self.ended:
            self.ended = b'"kind":"trace_end"' in self.follower.read()
        return self.ended


def _trace_clock(entries, scale: float, start_at: float):
    """utc -> trace seconds, from the bus log (its entries carry both; clock skips are entries)."""

    stamped = [(e.utc, e.trace_s) for e in entries if e.trace_s is not None and e.kind != "run_start"]
    if not stamped:
        return lambda utc: start_at
    first_utc, first_trace = stamped[0]
    start_utc = first_utc - (first_trace - start_at) * scale  # the trace clock's start
    times = [u for u, _ in stamped]

    def to_trace(utc: float) -> float:
        if utc <= start_utc:
            return start_at
        i = bisect.bisect_right(times, utc) - 1
        if i < 0:
            return start_at + (utc - start_utc) / scale
        u, t = stamped[i]
        return t + (utc - u) / scale

    return to_trace


def _unit_index(p: m.Progress, totals: dict[str, int]) -> int:
    """Position of a PROGRESS report in the request's whole sequence of units: the units of the
    earlier phases, then this phase's done count."""
    phase = str(p.phase)
    return int(p.done) + sum(totals.get(ph, 0) for ph, order in UNIT_ORDER.items() if order < UNIT_ORDER.get(phase, 0))


def _on_intervals(entries) -> list[tuple[float, float]]:
    out, on = [], None
    for e in entries:
        if e.kind == bl.POWER_ON:
            on = e.utc
        elif e.kind == bl.POWER_OFF and on is not None:
            out.append((on, e.utc))
            on = None
    if on is not None:
        out.append((on, time.time()))
    return out


def _busy_seconds(starts, completed_at, intervals) -> float:
    """Time the payload was on with this task running: from each STARTED to the end of that power
    interval (or to completion)."""
    total = 0.0
    for s in starts:
        end = next((b for a, b in intervals if a <= s <= b), s)
        if completed_at is not None and s <= completed_at <= end:
            end = completed_at
        total += max(0.0, end - s)
    return total
