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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flight.checkpoint.policies import Geometry, get_policy
from flight.recovery.cost import BlockCosts
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

    def copy(self) -> Durable:
        return Durable(
            self.vision_block, self.vision_done, dict(self.blocks), self.decode_steps, self.decode_records, self.done
        )


@dataclass
class Commit:
    t: float
    kind: str  # vision | vision_out | block | decode | result
    key: tuple[int, int] | None = None  # block: (group, chunk)
    value: int | tuple[bool, bool] | None = None  # vision/decode: the step; block: (has_kv, has_hidden)
    nbytes: int = 0
    started: float = 0.0


# ---- storage and the writer ---------------------------------------------------------------------
class Bucket:
    """common.durable.TokenBucket in modelled time: tokens accrue at `rate` up to `burst`, start
    empty when the process starts, and a take waits for a deficit to be paid."""

    def __init__(self, rate: float, burst: float, t0: float):
        self.rate, self.burst, self.tokens, self.last = rate, burst, 0.0, t0

    def take(self, t: float, nbytes: float) -> float:
        if self.burst <= 0:
            return nbytes / self.rate
        if t > self.last:
            self.tokens = min(self.burst, self.tokens + (t - self.last) * self.rate)
            self.last = t
        self.tokens -= nbytes
        return -self.tokens / self.rate if self.tokens < 0 else 0.0


class Writer:
    """flight.checkpoint.writer.CheckpointWriter in modelled time."""

    def __init__(self, platform: Platform, sync: bool, t0: float):
        st = platform.storage
        self.st, self.sync = st, sync
        self.bucket = Bucket(st.write_bytes_per_s, st.burst_bytes, t0)
        self.alive: list[float] = []  # end times of ordered records submitted, in order
        self.channel_free = t0
        self.busy: list[tuple[float, float]] = []
        self.commits: list[Commit] = []
        self.background: tuple[float, float, Commit] | None = None  # (submitted, channel seconds, commit)
        self.bytes = 0

    def _duration(self, start: float, nbytes: int) -> float:
        st = self.st
        if st.burst_bytes > 0:  # testbench: this machine's commit, then the throttle's wait
            return st.write_latency_s + self.bucket.take(start + st.write_latency_s, nbytes)
        return st.write_latency_s + nbytes / st.write_bytes_per_s

    def outstanding(self, t: float) -> bool:
        return any(end > t for end in self.alive)

    def submit(self, t: float, commit: Commit, optional: bool = False) -> float:
        """Submit at `t`; returns when the compute thread goes on."""
        if self.sync:
            start = max(t, self.channel_free)
            end = start + self._duration(start, commit.nbytes)
            self._record(commit, start, end)
            return end
        live = [end for end in self.alive if end > t]
        if optional and live:
            return t  # dropped: the next state supersedes it (records_deferred)
        if len(live) >= 2:
            t = live[0]  # wait for a slot: the record being written finishes
        start = max(t, self.channel_free)
        end = start + self._duration(start, commit.nbytes)
        self._record(commit, start, end)
        return t

    def _record(self, commit: Commit, start: float, end: float) -> None:
        commit.t, commit.started = end, start
        self.channel_free = end
        self.alive.append(end)
        self.busy.append((start, end))
        self.commits.append(commit)
        self.bytes += commit.nbytes

    def submit_background(self, t: float, commit: Commit) -> float:
        if self.sync:
            return self.submit(t, commit)
        seconds = commit.nbytes / self.st.write_bytes_per_s + self.st.write_latency_s
        self.background = (t, seconds, commit)
        self.bytes += commit.nbytes
        return t

    def background_end(self) -> float | None:
        """When vision.out commits: it is written in the gaps between ordered records."""
        if self.background is None:
            return None
        t, left, commit = self.background
        for start, end in sorted(self.busy):
            if end <= t:
                continue
            if start > t:
                gap = start - t
                if gap >= left:
                    break
                left -= gap
            t = max(t, end)
        commit.t, commit.started = t + left, self.background[0]
        return commit.t

    def drain(self, t: float) -> float:
        background_end = self.background_end()
        end = max([t, self.channel_free] + ([background_end] if background_end is not None else []))
        if self.background is not None and self.background[2] not in self.commits:
            self.commits.append(self.background[2])
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

    def durable_at(self, before: Durable, cut: float) -> Durable:
        d = before.copy()
        for c in sorted(self.commits, key=lambda c: c.t):
            if c.t > cut:
                continue
            if c.kind == "vision":
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
        self.g = self.policy.geometry(geometry, spec.text.layers)
        self.planner = planner
        self.sizes = RecordSizes(spec, request, self.g.chunk, self.g.group)
        self.groups, self.chunks = self.sizes.groups, self.sizes.chunks
        self.NG, self.NC = len(self.groups), len(self.chunks)
        self.costs = platform.block_costs(self.groups, self.chunks)
        self.V = spec.vision.depth
        self.writes = self.policy.writes_checkpoints()

    # ---- a session --------------------------------------------------------------------------
    def session(
        self, d: Durable, t_ready: float, process_start: float, warning_at: float | None = None
    ) -> SessionResult:
        p, pol, g = self.platform, self.policy, self.g
        sync = pol.synchronous_commits()
        w = Writer(p, sync, process_start)
        t = t_ready + p.setup_s
        res = SessionResult(math.inf, w.commits, t_ready)
        urgent_pending = warning_at is not None

        def urgent(now: float) -> bool:
            nonlocal urgent_pending
            if urgent_pending and warning_at is not None and warning_at <= now and self.writes:
                urgent_pending = False
                return True
            return False

        if not self.writes:
            d = Durable()
        # ---- vision
        vision_fresh = not d.vision_done and not d.blocks and not d.decode_records and self.request.visual_tokens > 0
        t_vision_start = t
        if vision_fresh:
            start_block = d.vision_block if d.vision_block else 0
            if start_block:
                t += self._read_s(self.sizes.vision_state(start_block))
            else:
                t += p.vision_extra_s / 2
            for i in range(start_block, self.V):
                t += p.vision_block_s
                if res.first_unit_at is None:
                    res.first_unit_at = t
                u = urgent(t) and i + 1 < self.V
                if u or pol.vision_state_due(i + 1, self.V, g):
                    t = w.submit(
                        t, Commit(0, "vision", value=i + 1, nbytes=self.sizes.vision_state(i + 1)), optional=not u
                    )
            t += p.vision_extra_s / 2
            if pol.persist_vision_out() and self.writes:
                t = w.submit_background(t, Commit(0, "vision_out", nbytes=self.sizes.vision_out))
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
        if (
            not vision_fresh
            and any(op.group == 0 and op.kind == "block" for op in plan.computes)
            and self.request.visual_tokens > 0
        ):
            t += self._read_s(self.sizes.vision_out)  # vision.out read by the first layer-0 compute
        costs = self._read_costs(plan, problem, t_vision_start if vision_fresh else t, process_start)
        origin = t_vision_start if vision_fresh else t  # weights stream behind the vision phase
        reads_end = sum(costs.read_s(op) for op in plan.reads)
        compute_from = t - origin if overlap else max(t - origin, reads_end)
        free_at = [compute_from]

        def after_compute(op, end):
            now = origin + end
            if res.first_unit_at is None:
                res.first_unit_at = now
            free_at[0] = end
            if op.kind != "block":
                return end
            persist = pol.prefill_block(op.group, op.chunk, self.NG, self.NC) if self.writes else None
            if persist is None:
                return end
            nbytes = self.sizes.prefill_block(op.group, op.chunk, persist.kv, persist.boundary_hidden)
            free = w.submit(
                now, Commit(0, "block", (op.group, op.chunk), (persist.kv, persist.boundary_hidden), nbytes)
            )
            free_at[0] = free - origin
            return free_at[0]

        sched = simulate(plan, problem, costs, compute_from=compute_from, after_compute=after_compute)
        t = origin + max(sched.read_end, free_at[0], sched.compute_end)
        res.phase_s["prefill"] = t - t_prefill
        res.restart_prefill_s = t - t_ready
        # ---- decode
        t_decode = t
        N = self.request.new_tokens
        if d.decode_records:
            t += self._read_s(self.sizes.decode(max(1, d.decode_steps)) * 1.0)
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
            finished = step + 1 >= N
            u = urgent(t)
            if not finished and (u or pol.decode_record_due(step - submitted, g, finished)) and self.writes:
                t = w.submit(t, Commit(0, "decode", value=step, nbytes=self.sizes.decode(step - submitted)))
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

    def _read_s(self, nbytes: float) -> float:
        st = self.platform.storage
        return st.read_latency_s + nbytes / st.read_bytes_per_s

    def _read_costs(self, plan, problem, origin: float, process_start: float):
        """The plan's read costs: record bytes at the storage's rate; with a token bucket (the
        testbench), charged in plan order from the process's start, burst included."""

        c = self.costs
        kv = np.zeros((self.NG, self.NC))
        hidden = np.zeros((self.NG, self.NC))
        weights = np.array(c.weights, dtype=float)
        st = self.platform.storage
        bucket = Bucket(st.read_bytes_per_s, st.burst_bytes, process_start) if st.burst_bytes > 0 else None
        t = origin
        for op in plan.reads:
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
            seconds = bucket.take(t, nbytes) if bucket is not None else st.read_latency_s + nbytes / st.read_bytes_per_s
            (kv if op.what == "kv" else hidden)[op.group, op.chunk] = seconds
            t += seconds
        return BlockCosts(weights, kv, hidden, np.array(c.compute), np.array(c.reproject), c.source)

    # ---- across windows -----------------------------------------------------------------------------
    def run(self, windows, arrival: float, warnings: dict | None = None, horizon: float = math.inf) -> Outcome:
        """`windows`: [(start, end)] power windows (end inf: open); the payload boots at each
        start. `warnings`: {window end: warning time}. The request is accepted at `arrival`."""
        d = Durable()
        sessions, bytes_written, cuts = 0, 0, 0
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
            res = self.session(d, t_ready, start, (warnings or {}).get(end))
            sessions += 1
            if res.finished_at <= end:
                bytes_written += sum(c.nbytes for c in res.commits)
                return Outcome(
                    True,
                    res.finished_at - arrival,
                    res.finished_at,
                    sessions,
                    cuts,
                    bytes_written + RecordSizes.MANIFEST_BYTES,
                )
            cuts += 1
            bytes_written += res.bytes_started_before(end)
            d = res.durable_at(d, end) if self.writes else Durable()
        return Outcome(False, None, None, sessions, cuts, bytes_written)

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


def trace_windows(trace) -> tuple[list[tuple[float, float]], dict]:
    """(windows, {cut time: warning time}) of a traces.Trace."""
    windows, warns = [], {}
    for w in trace.windows():
        end = w.end_s if w.cut_cause is not None else math.inf
        windows.append((w.start_s, end))
        if w.cut_cause is not None and w.warning_lead_s > 0:
            warns[end] = w.end_s - w.warning_lead_s
    return windows, warns
