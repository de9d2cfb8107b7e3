"""The request lifecycle across power windows, in modelled time.

One *session* is one power window of the payload with the request: boot, task start, then the
engine's phases exactly as flight/engine.py runs them -- vision blocks with the policy's vision
states, prefill through a recovery plan from the project's own planners (`make_plan`) scored by
its own plan simulator (`flight.recovery.simulate.simulate`, with the checkpoint writes hooked
onto the compute unit), decode steps with the policy's decode records, then RESULT. Checkpoint
writes go through a model of `flight.checkpoint.writer.CheckpointWriter`: synchronous (on the
compute path) or the background writer (ordered records, at most two alive, optional records
dropped while it is busy, `vision.out` in the gaps). Policies are the real policy objects of
flight/checkpoint/policies.py, so the simulator asks them what the engine asks.

A session is computed to its end and then cut: what had committed before the cut is the durable
state the next session starts from (records in order, vision buffers dropped once `vision.out`
is durable, decode records up to the last committed one). A shutdown warning makes the engine
persist at the next unit boundary (`checkpoint_soon`), as in the engine.

Around the engine, what the payload process does for a task (flight/runtime/worker.py): at a task's
first start it reads its uplinked images, builds the inputs and writes them as one TASK_INPUTS
record (on the compute path, through the same storage as the checkpoints); before every restart
it reads that record back (before its STARTED report). A payload process (`PayloadProcess`, one
per power window) serves the tasks one after the other and is shared by them: its storage
throttle (token buckets, empty when the process starts) and its checkpoint cadence (the real
`flight.checkpoint.cadence.Cadence`, fed with the windows the payload has lived through, the
bus's warnings and telemetry, and the modelled unit and record-write times, and asked what the
engine asks it: early vision states and decode records, which scheduled vision states to skip, and
each new task's prefill block shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from common.sim.windows import trace_windows  # noqa: F401 - shared with the ground (common/sim)
from flight.checkpoint.cadence import HISTORY_WINDOWS, Cadence
from flight.checkpoint.policies import Geometry, get_policy
from flight.recovery.cost import BlockCosts
from flight.recovery.executor import PlanExecutor
from flight.recovery.phases import needs_vision_out, vision_groups
from flight.recovery.plan import RecoveryProblem, make_plan
from flight.recovery.simulate import simulate

from .models import ModelSpec, RecordSizes, Request
from .platform import Platform


# ---- durable state ----------------------------------------------------------------------------
@dataclass
class Durable:
    vision_block: int = 0
    vision_done: bool = False
    blocks: dict = field(default_factory=dict)  # (g, c) -> (has_kv, has_hidden)
    decode_steps: int = 0  # steps covered by committed decode records
    decode_records: int = 0
    done: bool = False
    inputs_stored: bool = False  # the task's TASK_INPUTS record (written at its first start)
    group: int | None = None  # the prefill block's layers the task's MANIFEST pins (None: no MANIFEST yet)

    def copy(self) -> Durable:
        return Durable(
            self.vision_block,
            self.vision_done,
            dict(self.blocks),
            self.decode_steps,
            self.decode_records,
            self.done,
            self.inputs_stored,
            self.group,
        )


@dataclass
class Commit:
    t: float
    kind: str  # inputs | manifest | vision | vision_out | block | decode | result
    key: tuple[int, int] | None = None  # block: (group, chunk)
    value: int | tuple[bool, bool] | None = None  # vision/decode: the step; block: (has_kv, has_hidden)
    nbytes: int = 0
    started: float = 0.0


# ---- storage, the payload process and the writer ----------------------------------------------
class Bucket:
    """common.durable.TokenBucket in modelled time: tokens accrue at `rate` up to `burst`, start
    empty when the process starts, and a take waits for a deficit to be paid."""

    def __init__(self, rate: float, burst: float, t0: float):
        self.rate, self.burst, self.tokens, self.last = rate, burst, 0.0, t0

    def tokens_at(self, t: float) -> float:
        """The tokens at `t` (negative: a deficit still being paid), taking nothing."""
        if t > self.last:
            return min(self.burst, self.tokens + (t - self.last) * self.rate)
        return self.tokens

    def take(self, t: float, nbytes: float) -> float:
        if self.burst <= 0:
            return nbytes / self.rate
        if t > self.last:
            self.tokens = min(self.burst, self.tokens + (t - self.last) * self.rate)
            self.last = t
        self.tokens -= nbytes
        return -self.tokens / self.rate if self.tokens < 0 else 0.0


class PayloadProcess:
    """One payload process: the power window from its start (`started`: power-up plus the part
    of the boot before the process's storage and uptime clock exist) to the cut. Shared by every
    task it serves, one after the other: its storage throttle (`common.durable.ThrottledFS`: one
    read and one write token bucket, empty at process start) and its checkpoint cadence (one
    `Cadence` per process, flight/runtime/app.py), which runs on this process's modelled clock
    and learns what the real one learns, when it learns it (`at`)."""

    def __init__(self, platform: Platform, started: float, cadence: Cadence | None = None, feed=None, writes=()):
        st = platform.storage
        self.storage = st
        self.started = started
        self.write_bucket = Bucket(st.write_bytes_per_s, st.burst_bytes, started)
        self.read_bucket = Bucket(st.read_bytes_per_s, st.burst_bytes, started)
        self.cadence = cadence
        self.now = started
        self.ends = math.inf  # the cut that ends this process (Payload.process)
        self._feed = feed  # (cadence, since, until): delivers the bus's warnings and telemetry
        self._fed_until = started
        self._writes: list[tuple[float, str, float, int]] = []  # (end, phase, seconds, bytes): timed record writes
        # those the cadence has been told, in order, with the write times it started from: a
        # session is modelled past its cut (and truncated after), so what the process had
        # measured by its cut is rebuilt from these (`writes_measured_by`)
        self._observed: list[tuple[float, str, float, int]] = []
        self._initial_writes = cadence.learned_writes() if cadence is not None else {}
        # the runtime's own writes at known times (uplinked image chunks), charged to the write
        # bucket in time order with the modelled ones
        self._runtime_writes = sorted((t, st.data_bytes(n)) for t, n in writes if t >= started)

    def clock(self) -> float:
        return self.now

    def at(self, t: float) -> Cadence | None:
        """Bring the cadence to modelled time `t`: the warnings and telemetry the bus sent and
        the record writes that ended since, in time order. Returns the cadence."""
        if self.cadence is None:
            return None
        if self._feed is not None and t > self._fed_until:
            self._feed(self, self._fed_until, t)
            self._fed_until = t
        if self._writes:
            done = sorted(w for w in self._writes if w[0] <= t)
            self._writes = [w for w in self._writes if w[0] > t]
            for end, phase, seconds, nbytes in done:
                self.now = max(self.now, end)
                self.cadence.observe_write(phase, seconds, nbytes)
                self._observed.append((end, phase, seconds, nbytes))
        self.now = max(self.now, t)
        return self.cadence

    def writes_measured_by(self, t: float) -> dict[str, float]:
        """The record write times this process's cadence held at `t` (what `state/write-costs`
        says after a cut at `t`): the ones it started from, smoothed with each write that ended
        by then, as `Cadence.observe_write` smooths them."""
        replay = Cadence("adaptive", write_s=self._initial_writes)
        for end, phase, seconds, nbytes in sorted(self._observed + self._writes):
            if end <= t:
                replay.observe_write(phase, seconds, nbytes)
        return replay.learned_writes()

    def timed_write(self, start: float, end: float, phase: str, nbytes: int = 0) -> None:
        """A record write the engine times for the cadence (RecordSink._timed): it learns the
        write's duration (and, from its size, the storage's seconds per byte) when it ends."""
        if self.cadence is not None:
            self._writes.append((end, phase, end - start, nbytes))

    def write_wait(self, t: float, nbytes: float) -> float:
        """The write bucket's wait for `nbytes` written at `t`, after the runtime's writes before it."""
        self._runtime_writes_before(t)
        return self.write_bucket.take(t, nbytes)

    def write_tokens(self, t: float) -> float:
        """The write bucket's tokens at `t` (after the runtime's writes before it); 0 unthrottled."""
        if self.storage.burst_bytes <= 0:
            return 0.0
        self._runtime_writes_before(t)
        return self.write_bucket.tokens_at(t)

    def write_take(self, t: float, nbytes: float) -> None:
        """Charge `nbytes` written from `t` on to the write bucket (a no-op unthrottled)."""
        if self.storage.burst_bytes > 0:
            self._runtime_writes_before(t)
            self.write_bucket.take(t, nbytes)

    def _runtime_writes_before(self, t: float) -> None:
        while self._runtime_writes and self._runtime_writes[0][0] <= t:
            at, n = self._runtime_writes.pop(0)
            self.write_bucket.take(at, n)

    def read_s(self, t: float, nbytes: float) -> float:
        """A read through this process's storage at `t`: its token bucket where throttled."""
        st = self.storage
        if st.burst_bytes > 0:
            return self.read_bucket.take(t, nbytes)
        return st.read_latency_s + nbytes / st.read_bytes_per_s


class Payload:
    """The payload across a run's power windows: one `PayloadProcess` per window, created when
    first needed and shared by every request that window's process serves. `cadence`: the
    payload's --cadence; with "adaptive", each process's `Cadence` is the real one, given the
    lengths of the windows lived through before it (the payload's window log: the process's
    uptime at the cut, for every window since the run began, the most recent HISTORY_WINDOWS),
    the write times the processes before it measured (the payload's `state/write-costs`: those
    of the latest earlier process, as of its cut), the bus's shutdown warnings (`warnings`: {cut:
    warning time}) and its power and thermal
    telemetry (`telemetry(t)` -> (payload temperature or None, battery state of charge or None),
    one round every `telemetry_step_s`), all in modelled seconds. `writes`: [(time, bytes)] the
    payload's runtime writes beside the modelled ones (uplinked images as the payload stores them),
    through the write bucket of the process up then. `write_s`: the write times on disk when the
    run begins (none for a fresh payload, as the testbench's)."""

    def __init__(
        self,
        platform: Platform,
        windows,
        warnings: dict | None = None,
        cadence: str = "fixed",
        telemetry=None,
        telemetry_step_s: float = 1.0,
        writes=(),
        write_s: dict | None = None,
    ):
        self.platform = platform
        self.writes = list(writes)
        self.write_s = dict(write_s or {})  # state/write-costs at the run's start (a fresh payload: none)
        self.windows = sorted(windows)
        self.warnings = warnings or {}
        self.mode = cadence
        self.telemetry = telemetry
        self.telemetry_step_s = telemetry_step_s
        self.processes: dict[float, PayloadProcess] = {}

    def process(self, start: float, end: float) -> PayloadProcess:
        if start not in self.processes:
            started = start + self.platform.process_start_at(start)
            cadence = None
            if self.mode == "adaptive":
                history = [
                    b - (a + self.platform.process_start_at(a))
                    for a, b in self.windows
                    if b <= start and b > a + self.platform.process_start_at(a)
                ]
                cadence = Cadence(
                    "adaptive", history[-HISTORY_WINDOWS:], started=started, write_s=self._writes_learned(start)
                )
            mine = [(t, n) for t, n in self.writes if started <= t < end]
            proc = PayloadProcess(self.platform, started, cadence, self._feeder(end), mine)
            proc.ends = end
            if cadence is not None:
                cadence.clock = proc.clock
            self.processes[start] = proc
        return self.processes[start]

    def _writes_learned(self, start: float) -> dict[str, float]:
        """The write times on disk at power-up `start`: those the latest earlier process had
        measured by its cut (the real one keeps them every marking period, at most 2 s)."""
        earlier = [s for s in self.processes if s < start]
        if not earlier:
            return dict(self.write_s)
        proc = self.processes[max(earlier)]
        if proc.cadence is None:
            return {}
        return proc.writes_measured_by(proc.ends)

    def _feeder(self, end: float):
        warning_at = self.warnings.get(end)

        def feed(proc: PayloadProcess, since: float, until: float) -> None:
            cadence = proc.cadence
            assert cadence is not None
            events: list[tuple[float, int]] = []
            if warning_at is not None and since < warning_at <= until and warning_at >= proc.started:
                events.append((warning_at, 0))
            if self.telemetry is not None:
                step = self.telemetry_step_s
                k = math.floor(max(since, proc.started) / step) + 1
                while k * step <= until:
                    events.append((k * step, 1))
                    k += 1
            for t, kind in sorted(events):
                proc.now = max(proc.now, t)
                if kind == 0:
                    cadence.warning(end - t)  # ShutdownWarning: the cut comes `lead` from now
                else:
                    assert self.telemetry is not None
                    temperature, soc = self.telemetry(t)
                    if temperature is not None:
                        cadence.thermal(t, temperature)
                    if soc is not None:
                        cadence.power(t, soc)

        return feed


class Writer:
    """flight.checkpoint.writer.CheckpointWriter in modelled time, writing through its process's
    storage (the write token bucket the process shares with its other writes)."""

    def __init__(self, platform: Platform, sync: bool, process: PayloadProcess):
        st = platform.storage
        self.st, self.sync = st, sync
        self.process = process
        self.bucket = process.write_bucket
        self.alive: list[float] = []  # end times of ordered records submitted, in order
        self.ordered: list[tuple[float, float, int]] = []  # (start, end, bytes) of those records
        self.channel_free = process.started
        self.commits: list[Commit] = []
        self.background: Commit | None = None  # vision.out, written in the gaps between ordered records
        self._background_left = 0.0  # its bytes not written yet
        self._background_at = 0.0  # written up to here
        self.bytes = 0
        self.kept = True  # whether the last submission was kept (an optional one may be dropped)

    def _duration(self, start: float, nbytes: float) -> float:
        st = self.st
        if st.burst_bytes > 0:  # testbench: this machine's commit, then the throttle's wait
            return st.write_latency_s + self.process.write_wait(start + st.write_latency_s, nbytes)
        return st.write_latency_s + nbytes / st.write_bytes_per_s

    def outstanding(self, t: float) -> bool:
        return any(end > t for end in self.alive)

    def backlog(self, t: float) -> tuple[int, float, int]:
        """CheckpointWriter.backlog at `t`: bytes of the ordered records queued or being written,
        how long the one being written has been under way, its bytes (what the engine can know:
        not when they will end). A synchronous writer has none."""
        if self.sync:
            return 0, 0.0, 0
        pending = [(start, nbytes) for start, end, nbytes in self.ordered if end > t]
        writing = [(t - start, nbytes) for start, nbytes in pending if start <= t]
        under_way, nbytes = writing[0] if writing else (0.0, 0)
        return sum(n for _, n in pending), under_way, nbytes

    def submit(self, t: float, commit: Commit, optional: bool = False, phase: str | None = None) -> float:
        """Submit at `t`; returns when the compute thread goes on. `phase`: the write is timed
        for the cadence. `kept` says whether the record was kept."""
        self.kept = True
        if self.sync:
            start = max(t, self.channel_free)
            end = start + self._duration(start, commit.nbytes)
            self._record(commit, start, end, phase)
            return end
        live = [end for end in self.alive if end > t]
        if optional and live:
            self.kept = False
            return t  # dropped: the next state supersedes it (records_deferred)
        if len(live) >= 2:
            t = live[0]  # wait for a slot: the record being written finishes
        start = max(t, self.channel_free)
        self._advance_background(start)
        end = start + self._duration(start, commit.nbytes)
        self._record(commit, start, end, phase)
        return t

    def _record(self, commit: Commit, start: float, end: float, phase: str | None = None) -> None:
        commit.t, commit.started = end, start
        self.channel_free = end
        self.alive.append(end)
        self.ordered.append((start, end, commit.nbytes))
        self.commits.append(commit)
        self.bytes += commit.nbytes
        if phase is not None:
            self.process.timed_write(start, end, phase, commit.nbytes)

    def submit_background(self, t: float, commit: Commit) -> float:
        if self.sync:
            return self.submit(t, commit)
        commit.started = t
        self.background = commit
        self._background_left, self._background_at = float(commit.nbytes), t
        self.bytes += commit.nbytes
        return t

    def _advance_background(self, until: float) -> None:
        """The background record (vision.out) in the channel's idle time before `until`: it
        writes slice by slice while no ordered record is outstanding (CheckpointWriter's
        `between_slices`), through the same write bucket, so what it writes the ordered records
        after it wait for (common.durable.ThrottledFS)."""
        if self.background is None or self._background_left <= 0:
            return
        start = max(self._background_at, self.channel_free)
        if until <= start:
            return
        rate = self.st.write_bytes_per_s
        tokens = self.process.write_tokens(start)
        writable = max(0.0, tokens + rate * (until - start))
        if writable >= self._background_left:
            finish = start + max(0.0, (self._background_left - tokens) / rate)
            self.process.write_take(start, self._background_left)
            self._background_left = 0.0
            self.background.t = finish + self.st.write_latency_s
        else:
            self.process.write_take(start, writable)
            self._background_left -= writable
            self._background_at = until

    def background_end(self) -> float | None:
        """When vision.out commits: it is written in the gaps between ordered records."""
        if self.background is None:
            return None
        self._advance_background(math.inf)
        return self.background.t

    def drain(self, t: float) -> float:
        background_end = self.background_end()
        end = max([t, self.channel_free] + ([background_end] if background_end is not None else []))
        if self.background is not None and self.background not in self.commits:
            self.commits.append(self.background)
        return end


# ---- one session ----------------------------------------------------------------------------------
@dataclass
class SessionResult:
    finished_at: float  # RESULT durable (math.inf until the session has computed it)
    commits: list[Commit]
    started_at: float
    first_unit_at: float | None = None
    restart_prefill_s: float = 0.0  # restore + prefill time of this session
    phase_s: dict = field(default_factory=dict)
    reported_started_at: float | None = None  # the task's STARTED report (after its inputs' read)
    early_at: list = field(default_factory=list)  # when the adaptive cadence asked for an early record
    skipped_at: list = field(default_factory=list)  # when it skipped a scheduled vision state
    prefill_end_at: float = math.inf  # when this session's prefill ended

    def durable_at(self, before: Durable, cut: float) -> Durable:
        d = before.copy()
        for c in sorted(self.commits, key=lambda c: c.t):
            if c.t > cut:
                continue
            if c.kind == "inputs":
                d.inputs_stored = True
            elif c.kind == "manifest":
                assert isinstance(c.value, int)  # a MANIFEST carries the task's block shape
                d.group = c.value
            elif c.kind == "vision":
                assert isinstance(c.value, int)  # a vision commit carries its block count
                d.vision_block = max(d.vision_block, c.value)
            elif c.kind == "vision_out":
                d.vision_done, d.vision_block = True, 0
            elif c.kind == "block":
                d.blocks[c.key] = c.value
            elif c.kind == "decode":
                assert isinstance(c.value, int)  # a decode commit carries its step
                d.decode_steps, d.decode_records = c.value, d.decode_records + 1
            elif c.kind == "result":
                d.done = True
        return d

    def bytes_started_before(self, cut: float) -> int:
        return sum(c.nbytes for c in self.commits if c.started < cut)


#: checkpoint records (what the policies write), as opposed to the runtime's TASK_INPUTS record
CHECKPOINT_KINDS = ("manifest", "vision", "vision_out", "block", "decode", "result")


class RequestModel:
    """One request of a model under a policy on a platform."""

    def __init__(
        self,
        spec: ModelSpec,
        request: Request,
        platform: Platform,
        policy: str,
        geometry: Geometry,
        planner: str = "optimal",
    ):
        self.spec, self.request, self.platform = spec, request, platform
        self.policy = get_policy(policy)
        self.policy_name = policy
        self.configured = self.policy.geometry(geometry, spec.text.layers)
        self.planner = planner
        self.V = spec.vision.depth
        self.writes = self.policy.writes_checkpoints()
        self._shapes: dict[int, tuple] = {}
        self._use_group(self.configured.group)

    def _use_group(self, group: int) -> None:
        """The task's geometry with `group` layers per prefill block (what its MANIFEST pins)."""
        if group not in self._shapes:
            g = replace(self.configured, group=group)
            sizes = RecordSizes(self.spec, self.request, g.chunk, g.group)
            text = self.spec.text
            costs = self.platform.block_costs(
                sizes.groups, sizes.chunks, text.kv_bytes_per_token_layer, text.hidden * self.spec.dtype_bytes
            )
            self._shapes[group] = (g, sizes, costs)
        # what each operation takes, which is also what the payload's planner plans with (reads at
        # the rate each one really gets: PrefillRestore._plan_costs)
        self.g, self.sizes, self.costs = self._shapes[group]
        self.groups, self.chunks = self.sizes.groups, self.sizes.chunks
        self.NG, self.NC = len(self.groups), len(self.chunks)

    def adaptive(self, process: PayloadProcess) -> bool:
        """The engine's `adaptive`: a policy that takes the adaptive cadence, under it (and checkpoints on)."""
        return process.cadence is not None and self.policy.adaptive_cadence and self.writes

    def task_group(self, d: Durable, process: PayloadProcess, now: float) -> int:
        """Engine.task_geometry: the group a resume reads back from the MANIFEST, else the
        configured one, or under the adaptive cadence `Cadence.prefill_group` with one decoder
        layer on one chunk at this platform's cost (the pace on the testbench, the planner's
        cost model on a target)."""
        if d.group is not None:
            return d.group
        cadence = process.at(now)
        if cadence is None or not self.adaptive(process):
            return self.configured.group
        chunk_tokens = min(self.configured.chunk, self.request.prompt_tokens)
        group = cadence.prefill_group(self.configured.group, self.platform.layer_chunk_s(chunk_tokens))
        return min(group, self.spec.text.layers)

    # ---- a session --------------------------------------------------------------------------
    def session(
        self,
        d: Durable,
        t_ready: float,
        process: float | PayloadProcess,
        warning_at: float | None = None,
    ) -> SessionResult:
        """One session from `t_ready` (the payload is up and takes the task) with durable state
        `d`, in `process` (a PayloadProcess, or the time a fresh one started)."""
        p, pol = self.platform, self.policy
        proc = process if isinstance(process, PayloadProcess) else PayloadProcess(p, process)
        sync = pol.synchronous_commits()
        w = Writer(p, sync, proc)
        t = t_ready
        res = SessionResult(math.inf, w.commits, t_ready)
        soon = [warning_at is not None]  # Engine.checkpoint_soon, set by the bus's warning
        if not self.writes:
            d = Durable(inputs_stored=d.inputs_stored)

        def warned(now: float) -> bool:
            """RequestContext.checkpoint_requested at `now`: warned, and checkpoints on."""
            return soon[0] and warning_at is not None and warning_at <= now and self.writes

        # ---- the task's inputs (flight/runtime/worker.py, Worker._run_task): read back before STARTED on a
        # restart (the TASK_INPUTS record; its pixels only if the vision phase starts from them,
        # below); at the first start, the images read before STARTED, and after it the inputs
        # built (in the setup) and written, pixels first, on the compute path
        first_start = not d.inputs_stored
        data = p.storage.data_bytes  # the payload's own data, not checkpoint records
        if not first_start:
            t += proc.read_s(t, data(self.sizes.task_inputs))
        elif self.request.image_bytes:  # one read per image file (unknown sizes: not charged)
            for _ in range(self.request.images):
                t += proc.read_s(t, data(self.request.image_bytes / self.request.images))
        res.reported_started_at = t
        t += p.first_setup_s if first_start and p.first_setup_s is not None else p.setup_s
        if first_start:  # written by the worker itself (save_inputs), not by the checkpoint writer
            pixels_end = t + w._duration(t, data(self.sizes.task_pixels))
            end = pixels_end + w._duration(pixels_end, data(self.sizes.task_inputs))
            nbytes = self.sizes.task_pixels + self.sizes.task_inputs
            # durable when the TASK_INPUTS record (the second) is: it commits both
            w.commits.append(Commit(end, "inputs", nbytes=nbytes, started=t))
            w.channel_free, w.bytes, t = end, w.bytes + nbytes, end
        # ---- the engine: the task's geometry (a new task's MANIFEST pins its block shape)
        group = self.task_group(d, proc, t)
        self._use_group(group)
        g = self.g
        if d.group is None and self.writes:
            w.commits.append(Commit(t, "manifest", value=group, started=t))
        # ---- vision
        vision_fresh = not d.vision_done and not d.blocks and not d.decode_records and self.request.visual_tokens > 0
        t_vision_start = t
        adaptive = self.adaptive(proc)
        if vision_fresh:
            t = self._vision_phase(d, t, proc, w, res, warned, soon, first_start)
        res.phase_s["vision"] = t - t_vision_start
        # ---- prefill (a recovery plan; the fresh run is the plan with nothing done)
        t_prefill = t
        problem = RecoveryProblem(
            self.NG,
            self.NC,
            set(d.blocks),
            {b for b, (_, h) in d.blocks.items() if h},
            need_last_hidden=d.decode_records == 0,
            kv_missing={b for b, (kv, _) in d.blocks.items() if not kv},
        )
        planner, overlap = pol.recovery(self.planner, True)
        overlap = overlap or not d.blocks  # a fresh prefill streams its weights behind the compute
        if planner == "optimal":
            problem.costs = self.costs.as_dict()
        plan = make_plan(planner, problem)
        origin = t_vision_start if vision_fresh else t  # weights stream behind the vision phase
        costs: BlockCosts | None = None
        vision_at, vision_read_end = None, None  # the compute that reruns the vision phase, its input read
        # the computes that need the vision output, as PrefillRestore finds them (no visual
        # tokens: none; else every chunk counts as visual, the simulator does not place them)
        groups_with_vision = vision_groups(self.groups, len(self.spec.vision.deepstack))
        visual = frozenset(range(self.NC)) if self.request.visual_tokens > 0 else frozenset()
        needs_vision = [op for op in plan.computes if needs_vision_out(op, groups_with_vision, visual)]
        if not vision_fresh and needs_vision:
            if d.vision_done:
                t += proc.read_s(t, self.sizes.vision_out)  # the plan's first read, which they wait for
                origin = t
            else:
                # vision.out never became durable (it is written behind the prefill blocks): the
                # first of those computes runs the vision phase again from the newest vision state
                # (VisionPhase.out), on the compute unit, just before its own block. Its read goes
                # through the read bucket when that compute's own inputs are in, behind the plan's
                # reads issued by then, and the plan's later reads wait behind it (a token bucket
                # serves in order).
                vision_at = plan.computes.index(needs_vision[0])
                needs, _ = PlanExecutor(plan, None, None).dependencies(needs_vision[0])
                after = max(plan.reads.index(r) for r in needs)
                costs, vision_read_end = self._read_costs(
                    plan, origin, proc, extra=(after, self._vision_input_bytes(d, first_start))
                )
        if costs is None:
            costs, _ = self._read_costs(plan, origin, proc)

        def rerun_vision(now: float) -> float:
            """The vision phase again, from `now`: returns when the compute unit is free."""
            end = self._vision_phase(d, now, proc, w, res, warned, soon, first_start, input_read_end=vision_read_end)
            res.phase_s["vision"] = end - now
            return end

        if vision_at == 0:
            t = rerun_vision(t)
        reads_end = sum(costs.read_s(op) for op in plan.reads)
        compute_from = t - origin if overlap else max(t - origin, reads_end)
        free_at = [compute_from]
        computed = [0]

        def after_compute(op, end):
            now = origin + end
            if res.first_unit_at is None:
                res.first_unit_at = now
            free_at[0] = end
            persist = None
            if op.kind == "block" and self.writes:
                persist = pol.prefill_block(op.group, op.chunk, self.NG, self.NC)
            if persist is not None:
                nbytes = self.sizes.prefill_block(op.group, op.chunk, persist.kv, persist.boundary_hidden)
                free = w.submit(
                    now, Commit(0, "block", (op.group, op.chunk), (persist.kv, persist.boundary_hidden), nbytes)
                )
                free_at[0] = free - origin
            computed[0] += 1
            if computed[0] == vision_at:  # the next compute needs the vision output
                free_at[0] = rerun_vision(origin + free_at[0]) - origin
            return free_at[0]

        sched = simulate(plan, problem, costs, compute_from=compute_from, after_compute=after_compute)
        t = origin + max(sched.read_end, free_at[0], sched.compute_end)
        res.phase_s["prefill"] = t - t_prefill
        res.prefill_end_at = t
        res.restart_prefill_s = t - t_ready
        # ---- decode
        t_decode = t
        N = self.request.new_tokens
        if d.decode_records:
            t += proc.read_s(t, self.sizes.decode(max(1, d.decode_steps)) * 1.0)
            step = d.decode_steps
            if step + 1 >= N:
                t += p.decode_step_s  # finished, but RESULT was not durable: redo the last step
        else:
            step = 0
        submitted = step
        while step + 1 < N:
            t += p.decode_step_s
            step += 1
            if res.first_unit_at is None:
                res.first_unit_at = t
            cadence = proc.at(t)
            if cadence is not None:
                cadence.observe_unit("decode", p.decode_step_s)
            finished = step + 1 >= N
            if finished or not self.writes:
                continue  # the final step is covered by RESULT
            nbytes = self.sizes.decode(step - submitted)
            if warned(t) or pol.decode_record_due(step - submitted, g, finished):
                soon[0] = False
                t = w.submit(t, Commit(0, "decode", value=step, nbytes=nbytes), phase="decode")
                submitted = step
            elif adaptive:
                assert cadence is not None
                if cadence.early_record("decode", step - submitted, g.decode_every):
                    res.early_at.append(t)
                    # optional: a record the busy writer drops is covered by the next
                    t = w.submit(t, Commit(0, "decode", value=step, nbytes=nbytes), optional=True, phase="decode")
                    if w.kept:
                        submitted = step
        res.phase_s["decode"] = t - t_decode
        t = w.drain(t)
        if self.writes:
            t += w._duration(t, self.sizes.result) + p.result_s
            w.commits.append(Commit(t, "result", nbytes=self.sizes.result, started=t))
        else:
            t += p.result_s
        res.finished_at = t
        return res

    def _vision_input_bytes(self, d: Durable, first_start: bool) -> float:
        """What VisionPhase.run reads before its first block: the newest vision state, or (from
        the patches, on a restart) the stored pixels, in device bytes."""
        if d.vision_block:
            return self.sizes.vision_state(d.vision_block)
        return 0.0 if first_start else self.platform.storage.data_bytes(self.sizes.task_pixels)

    def _vision_phase(
        self,
        d: Durable,
        t: float,
        proc: PayloadProcess,
        w: Writer,
        res: SessionResult,
        warned,
        soon,
        first_start: bool,
        input_read_end: float | None = None,
    ) -> float:
        """VisionPhase.run from `d`'s newest vision state (or the patches): its blocks, the
        vision states its cadence keeps, and vision.out handed to the writer in the background.
        `input_read_end`: its input's read was charged by the caller (among the plan's reads)
        and ends then. Returns when it ends."""
        p, pol, g = self.platform, self.policy, self.g
        adaptive = self.adaptive(proc)
        start_block = d.vision_block if d.vision_block else 0
        if input_read_end is not None:
            t = max(t, input_read_end)
        elif nbytes := self._vision_input_bytes(d, first_start):
            t += proc.read_s(t, nbytes)
        if not start_block:
            t += p.vision_extra_s / 2
        last_state, deferred, last_early = start_block, 0, False
        for i in range(start_block, self.V):
            t += p.vision_block_s
            if res.first_unit_at is None:
                res.first_unit_at = t
            done = i + 1
            cadence = proc.at(t)
            if cadence is not None:
                cadence.observe_unit("vision", p.vision_block_s)
            u = done < self.V and warned(t)
            scheduled = pol.vision_state_due(done, self.V, g)
            nbytes = self.sizes.vision_state(done)
            skipped = False
            if scheduled and not u and adaptive and not w.sync and done < self.V:
                assert cadence is not None  # as VisionPhase.run: the adaptive rule may skip it
                skipped = cadence.skip_vision_state(done - last_state, self.V - done, nbytes, *w.backlog(t))
                scheduled = not skipped
                if skipped:
                    res.skipped_at.append(t)
            early = False
            if not scheduled and not skipped and adaptive and done < self.V:
                assert cadence is not None
                early = cadence.early_record("vision", done - last_state, g.vision_every)
                if early:
                    res.early_at.append(t)
            if u or scheduled or early:
                soon[0] = False
                t = w.submit(
                    t,
                    Commit(0, "vision", value=done, nbytes=nbytes),
                    # as the engine: a scheduled state is not dropped for an early one in flight
                    optional=not u and deferred == 0 and not (scheduled and last_early),
                    phase="vision",
                )
                if w.kept:
                    last_state, deferred, last_early = done, 0, early
                else:
                    deferred += 1
        t += p.vision_extra_s / 2
        if pol.persist_vision_out() and self.writes:
            t = w.submit_background(t, Commit(0, "vision_out", nbytes=self.sizes.vision_out))
        return t

    def _read_s(self, nbytes: float) -> float:
        """A read at the storage's rate (no throttle state: for estimates outside a session)."""
        st = self.platform.storage
        return st.read_latency_s + nbytes / st.read_bytes_per_s

    def _read_costs(self, plan, origin: float, proc: PayloadProcess, extra: tuple[int, float] | None = None):
        """(the plan's read costs, the end of the `extra` read): record bytes at the storage's
        rate; with a token bucket (the testbench), charged in plan order through the process's
        read bucket. `extra` = (index, bytes): a read of the compute thread's own, charged right
        after the plan's read at that index (the reads after it wait for it)."""

        c = self.costs
        kv = np.zeros((self.NG, self.NC))
        hidden = np.zeros((self.NG, self.NC))
        weights = np.array(c.weights, dtype=float)
        t = origin
        extra_end = None
        for index, op in enumerate(plan.reads):
            if extra is not None and index == extra[0] + 1:
                t += proc.read_s(t, extra[1])
                extra_end = t
            if op.what == "weights":
                t += weights[op.group]
                continue
            (l0, l1), (s, e) = self.groups[op.group], self.chunks[op.chunk]
            spec = self.spec.text
            nbytes = (
                (l1 - l0) * (e - s) * spec.kv_bytes_per_token_layer
                if op.what == "kv"
                else (e - s) * spec.hidden * self.spec.dtype_bytes
            )
            seconds = proc.read_s(t, nbytes)
            (kv if op.what == "kv" else hidden)[op.group, op.chunk] = seconds
            t += seconds
        if extra is not None and extra_end is None:  # after the plan's last read
            t += proc.read_s(t, extra[1])
            extra_end = t
        return BlockCosts(weights, kv, hidden, np.array(c.compute), np.array(c.reproject), c.source), extra_end

    # ---- across windows -----------------------------------------------------------------------------
    def run(
        self,
        windows,
        arrival: float,
        warnings: dict | None = None,
        horizon: float = math.inf,
        payload: Payload | None = None,
    ) -> Outcome:
        """`windows`: [(start, end)] power windows (end inf: open); the payload boots at each
        start. `warnings`: {window end: warning time}. The request is accepted at `arrival`.
        `payload`: the payload processes it shares with the requests served before it (a run's
        queue); by default its own, with the fixed cadence."""
        payload = payload if payload is not None else Payload(self.platform, windows, warnings)
        d = Durable()
        sessions, bytes_written, cuts, early, skipped = 0, 0, 0, 0, 0
        p = self.platform
        first = True
        for start, end in windows:
            if end <= arrival or start >= horizon:
                continue
            boot = p.boot_at(start)
            if start <= arrival:
                t_ready = arrival + (p.first_start_s if first else 0.0)
                if arrival < start + boot:
                    t_ready = max(t_ready, start + boot)
            else:
                t_ready = start + boot
            first = False
            if t_ready >= end:
                continue
            res = self.session(d, t_ready, payload.process(start, end), (warnings or {}).get(end))
            sessions += 1
            early += sum(1 for at in res.early_at if at <= end)
            skipped += sum(1 for at in res.skipped_at if at <= end)
            if res.finished_at <= end:
                bytes_written += sum(c.nbytes for c in res.commits)
                return Outcome(
                    True,
                    res.finished_at - arrival,
                    res.finished_at,
                    sessions,
                    cuts,
                    bytes_written + RecordSizes.MANIFEST_BYTES,
                    self.g.group,
                    early,
                    skipped,
                )
            cuts += 1
            bytes_written += res.bytes_started_before(end)
            d = res.durable_at(d, end) if self.writes else Durable(inputs_stored=res.durable_at(d, end).inputs_stored)
        return Outcome(False, None, None, sessions, cuts, bytes_written, self.g.group, early, skipped)

    def uninterrupted(self) -> SessionResult:
        return self.session(Durable(), 0.0, 0.0)


@dataclass
class Outcome:
    completed: bool
    e2e_s: float | None
    finished_at: float | None
    sessions: int
    cuts: int
    bytes_written: int
    group: int | None = None  # the prefill block's layers the task ran with
    early_records: int = 0  # early records the adaptive cadence asked for before the cuts
    vision_states_skipped: int = 0  # scheduled vision states it skipped before the cuts


def trace_telemetry(trace):
    """telemetry(t) -> (payload temperature, battery state of charge) of a traces.Trace, as the
    bus reports them (None for a channel the trace does not measure), or None without telemetry."""
    if not trace.telemetry:
        return None

    def telemetry(t: float):
        sample = trace.telemetry_at(min(t, trace.duration_s))
        if sample is None:
            return None, None
        power = None not in (sample.bus_voltage_v, sample.battery_soc, sample.payload_power_w)
        return sample.payload_temp_c, sample.battery_soc if power else None

    return telemetry
