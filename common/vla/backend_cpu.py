"""CPU lockstep backend: two executor threads with split intra-op threads.

The CPU stand-in for Robion's two GPU streams: a VLM executor thread and an ADiT executor
thread run their stage batches at the same time; the VLM share of a lockstep becomes the share
of intra-op threads the VLM thread uses (`torch.set_num_threads` is per thread), the ADiT
thread takes the rest. A lockstep ends when both have finished (a barrier), exactly like the
GPU version synchronising both streams.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from common.vla.models import VlaPolicy
from common.vla.scheduler import LockstepPlan, StageBatch


@dataclass(frozen=True)
class LockstepTiming:
    vlm_ms: float
    adit_ms: float
    wall_ms: float
    vlm_threads: int
    adit_threads: int


def run_vlm_batch(policy: VlaPolicy, batch: StageBatch) -> None:
    reqs = batch.requests
    prefixes = policy.run_vlm([r.payload for r in reqs], batch.padded_size)
    for r, p in zip(reqs, prefixes, strict=True):
        r.prefix = p


def run_adit_batch(policy: VlaPolicy, batch: StageBatch) -> None:
    reqs = batch.requests
    actions = policy.run_adit([r.prefix for r in reqs], [r.payload for r in reqs], batch.padded_size)
    for r, a in zip(reqs, actions, strict=True):
        r.result = a
        r.prefix = None  # the prefix cache is not needed once the chunk exists


class _Executor(threading.Thread):
    """One stage executor: runs jobs with its own intra-op thread count."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.jobs: queue.Queue = queue.Queue()
        self._threads = 0

    def submit(self, fn: Callable[[], None], threads: int) -> Future:
        fut: Future = Future()
        self.jobs.put((fn, threads, fut))
        return fut

    def run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            fn, threads, fut = item
            try:
                if threads != self._threads:  # resizing the pool costs time; only when the split changes
                    torch.set_num_threads(threads)
                    self._threads = threads
                t0 = time.perf_counter()
                fn()
                fut.set_result((time.perf_counter() - t0) * 1e3)
            except BaseException as exc:  # the engine fails the batch's requests, the executor lives on
                fut.set_exception(exc)

    def stop(self) -> None:
        self.jobs.put(None)


class CpuLockstepBackend:
    name = "cpu"

    def __init__(self, total_threads: int | None = None):
        self.total_threads = max(1, int(total_threads or torch.get_num_threads()))
        self._vlm = _Executor("vla-vlm-executor")
        self._adit = _Executor("vla-adit-executor")
        self._vlm.start()
        self._adit.start()

    def split(self, vlm_share: float) -> tuple[int, int]:
        """Threads for (VLM, ADiT) when both run: at least one each; they may share a core."""
        if self.total_threads == 1:
            return 1, 1
        v = min(self.total_threads - 1, max(1, round(vlm_share * self.total_threads)))
        return v, self.total_threads - v

    def run(self, plan: LockstepPlan, policies: Mapping[str, VlaPolicy]) -> LockstepTiming:
        t0 = time.perf_counter()
        if plan.sequential:  # Monolithic: one pipeline on all threads

            def both():
                run_vlm_batch(policies[plan.vlm.model], plan.vlm)
                run_adit_batch(policies[plan.adit.model], plan.adit)

            ms = self._vlm.submit(both, self.total_threads).result()
            return LockstepTiming(ms, 0.0, (time.perf_counter() - t0) * 1e3, self.total_threads, 0)
        if plan.vlm and plan.adit:
            tv, ta = self.split(plan.vlm_share)
        else:  # one stage alone gets the whole machine
            tv = ta = self.total_threads
        vlm, adit = plan.vlm, plan.adit
        fv = self._vlm.submit(lambda: run_vlm_batch(policies[vlm.model], vlm), tv) if vlm else None
        fa = self._adit.submit(lambda: run_adit_batch(policies[adit.model], adit), ta) if adit else None
        # Lockstep barrier: wait for both stages; raise the first failure after both are done.
        results = []
        for f in (fv, fa):
            if f is not None:
                try:
                    results.append(f.result())
                except BaseException as exc:
                    results.append(exc)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        vlm_ms = results[0] if fv else 0.0
        adit_ms = results[-1] if fa else 0.0
        return LockstepTiming(vlm_ms, adit_ms, (time.perf_counter() - t0) * 1e3, tv if fv else 0, ta if fa else 0)

    def close(self, timeout: float = 10.0) -> None:
        # Joined, not only told to stop: an executor thread (one that has set its own intra-op
        # thread count) still alive while the interpreter shuts down made `ow vla serve` abort on
        # SIGTERM in 8 of 10 tries ("terminate called without an active exception", exit -6).
        self._vlm.stop()
        self._adit.stop()
        self._vlm.join(timeout)
        self._adit.join(timeout)
