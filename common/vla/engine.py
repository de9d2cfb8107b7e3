"""The real serving engine: the shared scheduler driving a real backend with real threads.

A coordinator thread repeatedly asks the scheduler for a lockstep plan, hands it to the backend
(CPU: two executor threads with split intra-op threads; CUDA: two streams, the VLM one on an SM
partition), waits for both stages (the lockstep barrier) and reports completion back to the
scheduler. Requests arrive from any thread (`submit`) and are answered through futures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from common import log as ow_log
from common.vla.config import model_spec
from common.vla.models import PolicyInputs, VlaPolicy, example_observation
from common.vla.scheduler import (
    LockstepPlan,
    LockstepScheduler,
    SequentialScheduler,
    Stage,
    StageBatch,
    VlaRequest,
    make_scheduler,
)


@dataclass(frozen=True)
class PolicyResult:
    actions: np.ndarray  # (horizon, output_action_dim)
    model: str
    request_id: int
    vlm_done_ms: float  # arrival -> VLM stage done
    total_ms: float  # arrival -> action chunk ready
    slo_ms: float
    slo_met: bool


@dataclass
class EngineStats:
    locksteps: int = 0
    served: int = 0
    slo_met: int = 0
    failed: int = 0
    lockstep_ms: list[float] = field(default_factory=list)


class EngineStopped(RuntimeError):
    pass


def select_backend(kind: str = "auto", threads: int | None = None):
    """'auto' picks CUDA when torch sees a GPU, else the CPU backend."""

    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        # lazy: torch/transformers (seconds to import), only the backend that runs
        from common.vla.backend_cuda import CudaLockstepBackend

        return CudaLockstepBackend()
    if kind == "cpu":
        # lazy: torch/transformers (seconds to import), only the backend that runs
        from common.vla.backend_cpu import CpuLockstepBackend

        return CpuLockstepBackend(threads)
    raise ValueError(f"unknown backend {kind!r} (auto, cpu, cuda)")


class ServingEngine:
    def __init__(
        self,
        policies: Mapping[str, VlaPolicy],
        scheduler: LockstepScheduler | SequentialScheduler,
        backend,
        slo_ms: Mapping[str, float],
        clock: Callable[[], float] = time.monotonic,
    ):
        missing = set(scheduler.models) - set(policies)
        if missing:
            raise ValueError(f"no policy loaded for {sorted(missing)}")
        self.policies, self.scheduler, self.backend = dict(policies), scheduler, backend
        self.slo_ms = dict(slo_ms)
        self.clock = clock
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._futures: dict[int, Future] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._log = ow_log.get("vla.engine", backend=backend.name)

    @classmethod
    def build(
        cls,
        models: list[str],
        *,
        system: str = "robion",
        policy: str = "esf",
        max_batch: int = 4,
        profile=None,
        slo_ms: Mapping[str, float] | None = None,
        backend: str = "auto",
        threads: int | None = None,
        batch_sizes: tuple[int, ...] | None = None,
    ) -> ServingEngine:
        """Load the models (tiny random weights) and wire scheduler and backend together."""
        be = select_backend(backend, threads)

        dtype = torch.bfloat16 if be.name == "cuda" else torch.float32
        device = "cuda" if be.name == "cuda" else "cpu"
        specs = [model_spec(m) for m in models]
        policies = {s.name: VlaPolicy(s, device=device, dtype=dtype) for s in specs}
        arch_of = {s.name: s.arch for s in specs}
        sched = make_scheduler(
            system, arch_of, policy=policy, max_batch=max_batch, profile=profile, batch_sizes=batch_sizes
        )
        slo = {}
        for s in specs:
            if slo_ms and s.name in slo_ms:
                slo[s.name] = float(slo_ms[s.name])
            elif profile is not None and s.arch in profile.archs:
                slo[s.name] = profile.slo_ms(s.arch)
            else:
                raise ValueError(f"no SLO for {s.name}: pass slo_ms or a profile that has {s.arch}")
        return cls(policies, sched, be, slo)

    # ---- requests ----
    def submit(self, model: str, inputs: PolicyInputs, robot: str = "") -> Future:
        fut: Future = Future()
        now = self.clock()
        slo = self.slo_ms.get(model)
        if slo is None:
            raise KeyError(f"model {model!r} is not served here (serving: {', '.join(self.slo_ms)})")
        req = VlaRequest(model, sent_at=now, arrived_at=now, deadline=now + slo / 1e3, robot=robot, payload=inputs)
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine is stopping")
            self.scheduler.submit(req)
            self._futures[req.request_id] = fut
            self._cv.notify()
        return fut

    # ---- lifecycle ----
    def warm_up(self) -> float:
        """Run every model's stages once at every fixed batch size, alone and side by side, before
        robots arrive: the first lockstep of a cold engine pays for allocator growth and thread-pool
        start-up (754 ms against ~50 ms warm). Bypasses the scheduler. Returns the seconds it took."""

        if self._thread is not None:
            raise RuntimeError("warm up before start()")
        t0 = time.perf_counter()
        sequential = isinstance(self.scheduler, SequentialScheduler)
        for model, policy in self.policies.items():
            arch = model_spec(model).arch
            for size in self.scheduler.batch_sizes:

                def batch(stage, model=model, policy=policy, arch=arch, size=size):
                    reqs = tuple(
                        VlaRequest(model, 0.0, 0.0, 1.0, payload=policy.prepare(example_observation(i)))
                        for i in range(size)
                    )
                    return StageBatch(stage, model, arch, reqs, size)

                first = batch(Stage.VLM)
                if sequential:
                    self.backend.run(
                        LockstepPlan(-1, first, StageBatch(Stage.ADIT, model, arch, first.requests, size), 1.0, True),
                        self.policies,
                    )
                    continue
                self.backend.run(LockstepPlan(-1, first, None, 1.0), self.policies)
                adit = StageBatch(Stage.ADIT, model, arch, first.requests, size)  # their prefixes exist now
                self.backend.run(LockstepPlan(-1, batch(Stage.VLM), adit, 0.5), self.policies)  # both at once
        seconds = time.perf_counter() - t0
        self._log.info("vla_engine_warmed_up", seconds=round(seconds, 3), batch_sizes=list(self.scheduler.batch_sizes))
        return seconds

    def start(self) -> ServingEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vla-coordinator", daemon=True)
            self._thread.start()
            self._log.info(
                "vla_engine_started",
                models=sorted(self.policies),
                scheduler=type(self.scheduler).__name__,
                policy=self.scheduler.policy_name,
                max_batch=self.scheduler.max_batch,
            )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:  # anything still queued is answered, not left hanging
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(EngineStopped("engine stopped before the request was served"))
            self._futures.clear()
        self.backend.close()
        self._log.info("vla_engine_stopped", served=self.stats.served, failed=self.stats.failed)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- coordinator ----
    def _next_plan(self) -> LockstepPlan | None:
        with self._cv:
            while True:
                if self._stopping:
                    return None
                plan = self.scheduler.plan(self.clock())
                if plan is not None:
                    return plan
                self._cv.wait()

    def _run(self) -> None:
        while (plan := self._next_plan()) is not None:
            try:
                timing = self.backend.run(plan, self.policies)
            except Exception as exc:  # fail this lockstep's requests; keep serving the others
                self._fail(plan, exc)
                continue
            now = self.clock()
            with self._cv:
                done = self.scheduler.complete(plan, now)
                self.stats.locksteps += 1
                self.stats.lockstep_ms.append(timing.wall_ms)
                futures = [(r, self._futures.pop(r.request_id, None)) for r in done]
            for r, fut in futures:
                self._resolve(r, fut)

    def _resolve(self, r: VlaRequest, fut: Future | None) -> None:
        slo = self.slo_ms[r.model]
        assert r.done_at is not None and r.vlm_done_at is not None  # the scheduler completed it
        total = (r.done_at - r.arrived_at) * 1e3
        result = PolicyResult(
            r.result, r.model, r.request_id, (r.vlm_done_at - r.arrived_at) * 1e3, total, slo, total <= slo
        )
        r.payload = r.result = None
        self.stats.served += 1
        self.stats.slo_met += result.slo_met
        if fut is not None and not fut.done():
            fut.set_result(result)

    def _fail(self, plan: LockstepPlan, exc: Exception) -> None:
        reqs = {r.request_id: r for b in (plan.vlm, plan.adit) if b for r in b.requests}
        self._log.error("vla_lockstep_failed", index=plan.index, error=repr(exc), requests=len(reqs))
        with self._cv:
            futures = [self._futures.pop(i, None) for i in reqs]
        self.stats.failed += len(reqs)
        for fut in futures:
            if fut is not None and not fut.done():
                fut.set_exception(exc)
