"""Discrete-event simulation of robots, network and GPUs, driven by the real scheduler code.

For each GPU the simulator instantiates the very `LockstepScheduler` / `SequentialScheduler`
the real engine uses and calls the same `submit / plan / complete`; only the execution is
replaced: a lockstep takes the time the profile table gives for its plan. Robots send at
`rate_hz` (2 Hz in the paper) with a random phase, over a WiFi 7-like network; a request meets
its SLO when the action chunk is back at the robot within the deadline. Several epochs resample
phases and network delays (the paper runs five).

The vLLM-Omni-style baseline (`kind="omni"`) and inter-GPU disaggregation (`kind="dis"`) are
simulated here with their own stage workers (see `OmniCluster`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from common.vla.config import ARCHS, model_spec
from common.vla.profiles import ProfileTable
from common.vla.scheduler import LockstepScheduler, SequentialScheduler, VlaRequest, make_scheduler, plan_ms


@dataclass(frozen=True)
class NetworkModel:
    """WiFi 7-like link: one-way delay = base + lognormal jitter + payload / throughput."""

    base_ms: float = 1.0
    jitter_median_ms: float = 1.0
    jitter_sigma: float = 0.6
    uplink_mbps: float = 1500.0
    downlink_mbps: float = 1500.0
    request_bytes: int = 2 * 224 * 224 * 3 + 1024  # a LIBERO observation (two images, state, prompt)
    response_bytes: int = 50 * 7 * 4 + 512  # an action chunk

    def delays(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Uplink and downlink delays in seconds for n requests."""
        up = (
            self.base_ms
            + self.jitter_median_ms * rng.lognormal(0.0, self.jitter_sigma, n)
            + self.request_bytes * 8 / (self.uplink_mbps * 1e3)
        )
        down = (
            self.base_ms
            + self.jitter_median_ms * rng.lognormal(0.0, self.jitter_sigma, n)
            + self.response_bytes * 8 / (self.downlink_mbps * 1e3)
        )
        return up / 1e3, down / 1e3


@dataclass(frozen=True)
class Workload:
    robots: Mapping[str, int]  # model -> robots
    rate_hz: float = 2.0
    duration_s: float = 10.0
    warmup_s: float = 1.0  # requests sent before this are served but not counted
    epochs: int = 5
    seed: int = 0

    @property
    def total_robots(self) -> int:
        return sum(self.robots.values())


@dataclass(frozen=True)
class SystemConfig:
    """What serves the robots.

    kind: "robion" (lockstep, shared scheduler), "monolithic" (shared scheduler, sequential),
    "omni" (vLLM-Omni-style: stage workers, FCFS, per-step admission, buffer inspection),
    "dis" (inter-GPU stage disaggregation with fixed batches and no inspection overhead).
    """

    kind: str = "robion"
    policy: str = "esf"
    max_batch: int | Mapping[str, int] = 4  # per model for robion/monolithic; one int for omni/dis
    sm_mode: str = "dynamic"
    static_share: float = 0.5
    vlm_gpus: tuple[int, ...] = (0,)
    adit_gpus: tuple[int, ...] = (0,)
    inspection_overhead: float = 0.325  # vLLM-Omni: buffer inspection is 30-35 % of latency (paper §2.5)
    step_admission: bool = True
    handoff_ms: float = 1.0  # orchestrator hop between stage workers (queue + shared-memory connector)
    link_gbs: float = 50.0  # inter-GPU copy bandwidth (PCIe 5.0 x16, effective)
    # Beyond the paper (robion only): a request whose ADiT ran in a lockstep gets its action when
    # its ADiT stream finishes, not at the lockstep's barrier (the slower VLM stream's end). Safe:
    # the two streams serve different requests, so the action is final once its ADiT is done;
    # the GPU still starts the next lockstep at the barrier (docs/vla.md "Early release").
    early_release: bool = False

    @property
    def label(self) -> str:
        if self.kind == "dis":
            return f"dis-{len(self.vlm_gpus)}:{len(self.adit_gpus)}"
        if self.kind == "robion" and self.early_release:
            return "robion-early-release"
        if self.kind == "robion" and self.sm_mode == "static":
            return "robion-static-sm"
        return {"robion": "robion", "monolithic": "monolithic", "omni": "vllm-omni-style"}[self.kind]


def robion(**kw) -> SystemConfig:
    return SystemConfig(kind="robion", **kw)


def monolithic(**kw) -> SystemConfig:
    return SystemConfig(kind="monolithic", **kw)


def vllm_omni(**kw) -> SystemConfig:
    return SystemConfig(kind="omni", **kw)


def disaggregated(vlm_gpus: int, adit_gpus: int, **kw) -> SystemConfig:
    """Paper Fig. 13's inter-GPU schemes: VLM on `vlm_gpus` GPUs, ADiT on the next `adit_gpus`."""
    return SystemConfig(
        kind="dis",
        vlm_gpus=tuple(range(vlm_gpus)),
        adit_gpus=tuple(range(vlm_gpus, vlm_gpus + adit_gpus)),
        inspection_overhead=0.0,
        step_admission=False,
        policy="esf",
        **kw,
    )


@dataclass(frozen=True)
class ModelStats:
    model: str
    requests: int
    met: int
    p50_ms: float
    p99_ms: float

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0


@dataclass(frozen=True)
class SimResult:
    system: str
    robots: int
    requests: int
    met: int
    p50_ms: float
    p99_ms: float
    per_model: dict[str, ModelStats] = field(default_factory=dict)
    locksteps: int = 0

    @property
    def attainment(self) -> float:
        """Pooled over every model's requests (for miss rates; targets use `worst_attainment`)."""
        return self.met / self.requests if self.requests else 1.0

    @property
    def worst_attainment(self) -> float:
        """The least SLO attainment of any model: a load meets the target only if every model does."""
        if not self.per_model:
            return self.attainment
        return min(s.attainment for s in self.per_model.values())

    @property
    def worst_model(self) -> str | None:
        return min(self.per_model.values(), key=lambda s: s.attainment).model if self.per_model else None

    @property
    def miss_rate(self) -> float:
        return 1.0 - self.attainment

    def per_model_text(self) -> str:
        return ", ".join(f"{m} {s.attainment:.1%}" for m, s in self.per_model.items())


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._q: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._q, (t, self._seq, fn, args))
        self._seq += 1

    def run(self, until: float) -> None:
        q = self._q
        while q and q[0][0] <= until:
            t, _, fn, args = heapq.heappop(q)
            self.now = t
            fn(*args)


# ---------------------------------------------------------------- servers


class LockstepGpu:
    """One GPU served by a shared scheduler; execution time comes from the profile."""

    def __init__(
        self,
        loop: EventLoop,
        scheduler: LockstepScheduler | SequentialScheduler,
        profile: ProfileTable,
        respond: Callable[[VlaRequest], None],
        early_release: bool = False,
    ):
        self.loop, self.scheduler, self.profile, self.respond = loop, scheduler, profile, respond
        self.early_release = early_release
        self.busy = False
        self.locksteps = 0

    def arrive(self, req: VlaRequest) -> None:
        self.scheduler.submit(req)
        self.kick()

    def kick(self) -> None:
        """Start a lockstep if the GPU is idle and anything is queued."""
        if not self.busy:
            self._start()

    def _start(self) -> None:
        plan = self.scheduler.plan(self.loop.now)
        if plan is None:
            self.busy = False
            return
        self.busy = True
        self.locksteps += 1
        self.loop.at(self.loop.now + plan_ms(self.profile, plan) / 1e3, self._finish, plan, self.loop.now)

    def _finish(self, plan, started: float) -> None:
        done = self.scheduler.complete(plan, self.loop.now)
        if self.early_release and done and not plan.sequential and plan.vlm is not None and plan.adit is not None:
            entry = self.profile.lockstep(
                plan.vlm.arch, plan.vlm.padded_size, plan.adit.arch, plan.adit.padded_size, share=plan.vlm_share
            )
            for r in done:  # the action leaves when its ADiT stream ends, at most at the barrier
                r.done_at = min(self.loop.now, started + entry.adit_ms / 1e3)
        for r in done:
            self.respond(r)
        self._start()


class _GpuTimeSlice:
    """Stage workers in separate processes on one GPU: without SM partitioning their kernels
    time-slice, so each worker iteration holds the GPU alone."""

    def __init__(self) -> None:
        self.busy = False
        self.waiters: deque = deque()

    def acquire(self, fn: Callable[[], None]) -> None:
        if self.busy:
            self.waiters.append(fn)
        else:
            self.busy = True
            fn()

    def release(self) -> None:
        if self.waiters:
            self.waiters.popleft()()
        else:
            self.busy = False


class OmniCluster:
    """vLLM-Omni-style serving: a VLM stage worker and an ADiT stage worker per assigned GPU,
    connected through an orchestrator. FCFS queues; the ADiT worker re-inspects its buffers and
    admits waiting requests before every denoising step (continuous batching), which costs
    `inspection_overhead` of the iteration time. `kind="dis"` reuses the workers with fixed
    batches, ESF-free FCFS and no inspection cost (the paper's inter-GPU schemes)."""

    def __init__(
        self,
        loop: EventLoop,
        cfg: SystemConfig,
        profile: ProfileTable,
        arch_of: Mapping[str, str],
        respond: Callable[[VlaRequest], None],
        batch_sizes: tuple[int, ...],
    ):
        self.loop, self.cfg, self.profile, self.arch_of, self.respond = loop, cfg, profile, arch_of, respond
        if not isinstance(cfg.max_batch, int):
            raise ValueError("stage-worker systems take one max batch for all models")
        self.sizes = tuple(b for b in batch_sizes if b <= cfg.max_batch)
        gpus = set(cfg.vlm_gpus) | set(cfg.adit_gpus)
        self.slices = {g: _GpuTimeSlice() for g in gpus}
        self.vlm_workers = [_VlmWorker(self, g) for g in cfg.vlm_gpus]
        self.adit_workers = [_AditWorker(self, g) for g in cfg.adit_gpus]
        self.iterations = 0

    def padded(self, n: int) -> int:
        for b in self.sizes:
            if b >= n:
                return b
        raise ValueError(f"batch {n} above the largest profiled size")

    def cost(self, seconds: float) -> float:
        return seconds / (1.0 - self.cfg.inspection_overhead)

    def arrive(self, req: VlaRequest) -> None:
        min(self.vlm_workers, key=lambda w: w.load()).arrive(req)

    def to_adit(self, req: VlaRequest, from_gpu: int) -> None:
        worker = min(self.adit_workers, key=lambda w: w.load())
        delay = self.cfg.handoff_ms / 1e3
        if worker.gpu != from_gpu:
            delay += self.profile.arch(self.arch_of[req.model]).handoff_bytes / (self.cfg.link_gbs * 1e9)
        self.loop.at(self.loop.now + delay, worker.arrive, req)


def _take_same_model(queue: deque, limit: int) -> list[VlaRequest]:
    """FCFS: the head request's model, then its followers of the same model."""
    head = queue[0].model
    out: list[VlaRequest] = []
    keep: deque[VlaRequest] = deque()
    while queue and len(out) < limit:
        r = queue.popleft()
        (out if r.model == head else keep).append(r)
    queue.extendleft(reversed(keep))
    return out


class _VlmWorker:
    def __init__(self, cluster: OmniCluster, gpu: int):
        self.c, self.gpu = cluster, gpu
        self.queue: deque[VlaRequest] = deque()
        self.busy = False

    def load(self) -> int:
        return len(self.queue) + self.busy

    def arrive(self, req):
        self.queue.append(req)
        self._try()

    def _try(self):
        if self.busy or not self.queue:
            return
        self.busy = True
        batch = _take_same_model(self.queue, self.c.cfg.max_batch)
        self.c.slices[self.gpu].acquire(lambda: self._run(batch))

    def _run(self, batch):
        c = self.c
        c.iterations += 1
        t = c.profile.vlm_alone(c.arch_of[batch[0].model], c.padded(len(batch))) / 1e3
        c.loop.at(c.loop.now + c.cost(t), self._done, batch)

    def _done(self, batch):
        self.c.slices[self.gpu].release()
        for r in batch:
            r.vlm_done_at = self.c.loop.now
            self.c.to_adit(r, self.gpu)
        self.busy = False
        self._try()


class _AditWorker:
    def __init__(self, cluster: OmniCluster, gpu: int):
        self.c, self.gpu = cluster, gpu
        self.waiting: deque[VlaRequest] = deque()
        self.running: list[list] = []  # [request, denoising steps left]
        self.busy = False

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def arrive(self, req):
        self.waiting.append(req)
        self._try()

    def _admit(self):
        cap = self.c.cfg.max_batch - len(self.running)
        if cap <= 0 or not self.waiting:
            return
        if self.running:  # a step batches one model: admit followers of the running model only
            model = self.running[0][0].model
            keep = deque()
            while self.waiting and cap:
                r = self.waiting.popleft()
                if r.model == model:
                    self.running.append([r, None])
                    cap -= 1
                else:
                    keep.append(r)
            self.waiting.extendleft(reversed(keep))
        else:
            self.running.extend([r, None] for r in _take_same_model(self.waiting, cap))

    def _try(self):
        if self.busy:
            return
        if self.c.cfg.step_admission or not self.running:
            self._admit()
        if not self.running:
            return
        self.busy = True
        self.c.slices[self.gpu].acquire(self._run)

    def _run(self):
        c = self.c
        c.iterations += 1
        arch = c.arch_of[self.running[0][0].model]
        steps = model_spec_steps(arch)
        for item in self.running:
            if item[1] is None:
                item[1] = steps
        full = c.profile.adit_alone(arch, c.padded(len(self.running))) / 1e3
        n = 1 if c.cfg.step_admission else steps  # per-step iterations, or the whole chunk at once
        c.loop.at(c.loop.now + c.cost(full * n / steps), self._done, n)

    def _done(self, n):
        self.c.slices[self.gpu].release()
        still = []
        for item in self.running:
            item[1] -= n
            if item[1] <= 0:
                item[0].done_at = self.c.loop.now
                self.c.respond(item[0])
            else:
                still.append(item)
        self.running = still
        self.busy = False
        self._try()


def model_spec_steps(arch: str) -> int:
    return ARCHS[arch].denoise_steps


# ---------------------------------------------------------------- the simulation


def simulate(
    system: SystemConfig,
    workload: Workload,
    profile: ProfileTable,
    *,
    assignment: Mapping[tuple[str, int], int] | None = None,
    slo_ms: Mapping[str, float] | None = None,
    network: NetworkModel = NetworkModel(),
    drain_s: float = 2.0,
    on_scheduler: Callable[[int, object], None] | None = None,
) -> SimResult:
    """Run `workload.epochs` epochs and pool their measured requests.

    assignment: robots per (model, GPU) for the lockstep/monolithic systems (e.g. from the
    traffic controller); default: every robot on GPU 0.
    """
    arch_of = {m: model_spec(m).arch for m in workload.robots}
    slo = {m: (slo_ms or {}).get(m, profile.slo_ms(arch_of[m])) / 1e3 for m in workload.robots}
    if assignment is None:
        assignment = {(m, 0): n for m, n in workload.robots.items()}
    for m, n in workload.robots.items():
        got = sum(k for (mm, _), k in assignment.items() if mm == m)
        if got != n:
            raise ValueError(f"assignment places {got} robots of {m}, workload has {n}")
    period = 1.0 / workload.rate_hz
    per_model_lat: dict[str, list[np.ndarray]] = {m: [] for m in workload.robots}
    locksteps = 0
    for epoch in range(workload.epochs):
        rng = np.random.default_rng([workload.seed, epoch])
        loop = EventLoop()
        latencies: dict[int, float] = {}
        measured: dict[int, tuple[str, float]] = {}
        down_delay: dict[int, float] = {}

        def respond(r: VlaRequest, _loop=loop, _lat=latencies, _down=down_delay):
            _lat[r.request_id] = r.done_at + _down[r.request_id] - r.sent_at

        targets: dict[tuple[str, int], Callable[[VlaRequest], None]] = {}
        gpu_servers: list[LockstepGpu] = []
        if system.kind in ("robion", "monolithic"):
            gpus = sorted({g for (_, g) in assignment})
            for g in gpus:
                hosted = {m: arch_of[m] for (m, gg), n in assignment.items() if gg == g and n > 0}
                if not hosted:
                    continue
                sched = make_scheduler(
                    system.kind,
                    hosted,
                    policy=system.policy,
                    max_batch=system.max_batch,
                    profile=profile,
                    sm_mode=system.sm_mode,
                    static_share=system.static_share,
                    record=False,
                )
                if on_scheduler is not None:
                    on_scheduler(g, sched)
                srv = LockstepGpu(loop, sched, profile, respond, early_release=system.early_release)
                gpu_servers.append(srv)
                for m in hosted:
                    targets[(m, g)] = srv.arrive
        else:
            cluster = OmniCluster(loop, system, profile, arch_of, respond, profile.batch_sizes)
            for key in assignment:
                targets[key] = cluster.arrive
        # Robot traffic: each robot sends at rate_hz from a random phase.
        for (m, g), n in sorted(assignment.items()):
            for _ in range(n):
                offset = rng.uniform(0.0, period)
                sends = np.arange(offset, workload.duration_s, period)
                up, down = network.delays(rng, len(sends))
                for t, u, d in zip(sends, up, down, strict=True):
                    req = VlaRequest(m, sent_at=float(t), arrived_at=float(t + u), deadline=float(t) + slo[m])
                    down_delay[req.request_id] = float(d)
                    if t >= workload.warmup_s:
                        measured[req.request_id] = (m, slo[m])
                    loop.at(req.arrived_at, targets[(m, g)], req)
        loop.run(workload.duration_s + drain_s + max(slo.values()))
        locksteps += sum(s.locksteps for s in gpu_servers)
        by_model: dict[str, list[float]] = {m: [] for m in workload.robots}
        for rid, (m, _) in measured.items():
            by_model[m].append(latencies.get(rid, math.inf))
        for m, lats in by_model.items():
            per_model_lat[m].append(np.asarray(lats, dtype=float))
    per_model = {}
    all_lat, met = [], 0
    for m, chunks in per_model_lat.items():
        lat = np.concatenate(chunks) if chunks else np.zeros(0)
        ok = int((lat <= slo[m] + 1e-12).sum())
        met += ok
        all_lat.append(lat)
        per_model[m] = ModelStats(m, len(lat), ok, _pct(lat, 50), _pct(lat, 99))
    lat = np.concatenate(all_lat) if all_lat else np.zeros(0)
    return SimResult(
        system.label, workload.total_robots, len(lat), met, _pct(lat, 50), _pct(lat, 99), per_model, locksteps
    )


def _pct(lat_s: np.ndarray, q: float) -> float:
    if lat_s.size == 0:
        return float("nan")
    return float(np.percentile(lat_s, q, method="higher")) * 1e3


def max_robots(
    run: Callable[[int], SimResult], target: float = 0.98, cap: int = 128, probe: int = 2
) -> tuple[int, dict[int, SimResult]]:
    """Largest load n at which every model's SLO attainment is >= target: doubling, then
    bisection, then probing the next `probe` loads above the answer (attainment falls with load,
    but random robot phases make the curve noisy, so one unlucky load must not end the search).
    Returns n and every result it simulated."""
    seen: dict[int, SimResult] = {}

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = run(n)
        return seen[n].worst_attainment >= target

    if not ok(1):
        return 0, seen
    lo, hi = 1, 2
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        if ok(cap):
            return cap, seen
        hi = cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    k = lo + 1
    while k <= min(cap, lo + probe):
        if ok(k):
            lo = k
        k += 1
    return lo, seen


def drain_backlog(
    scheduler: LockstepScheduler | SequentialScheduler, profile: ProfileTable, requests: list[VlaRequest]
) -> tuple[list[VlaRequest], float]:
    """Serve a backlog (every request already queued at t = 0) on one simulated GPU.

    Returns the requests in completion order and the simulated makespan in seconds. The real
    engine given the same backlog before it starts makes the same scheduling decisions.
    """
    loop = EventLoop()
    done: list[VlaRequest] = []
    gpu = LockstepGpu(loop, scheduler, profile, done.append)
    for r in requests:
        scheduler.submit(r)
    gpu.kick()
    loop.run(math.inf)
    return done, loop.now
