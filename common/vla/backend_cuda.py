"""CUDA lockstep backend: two CUDA streams, the VLM one restricted to an SM partition.

Selected when `torch.cuda.is_available()`. Robion §4.1: the VLM stage runs on a stream whose SMs
are restricted (a CUDA green context with the lockstep's share of SMs, rounded to the partition
granularity), the ADiT stage on an unrestricted stream, so the ADiT always finds free SMs while
the VLM runs. A lockstep starts both batches and ends when both streams are done.

NOT EXERCISED where this product is built (no GPU there): the code paths exist and are kept
small; everything else is tested with the CPU backend. Not implemented here: CUDA-graph capture
of the fixed batch sizes (the paper captures graphs at initialisation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch.cuda import green_contexts

from common.vla.backend_cpu import LockstepTiming, run_adit_batch, run_vlm_batch
from common.vla.models import VlaPolicy
from common.vla.scheduler import LockstepPlan

SM_GRANULARITY = 8  # green-context SM partitions come in multiples of 8 on Hopper/Blackwell


class CudaLockstepBackend:
    name = "cuda"

    def __init__(self, device: int = 0):
        self.device = torch.device("cuda", device)
        self.total_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.adit_stream = torch.cuda.Stream(self.device)
        self.full_stream = torch.cuda.Stream(self.device)
        self._green_supported = bool(getattr(green_contexts, "SUPPORTED", False))
        self._green: dict[int, tuple[object, torch.cuda.Stream]] = {}

    def vlm_sms(self, share: float) -> int:
        sms = int(share * self.total_sms) // SM_GRANULARITY * SM_GRANULARITY
        return max(SM_GRANULARITY, min(sms, self.total_sms))

    def vlm_stream(self, share: float) -> torch.cuda.Stream:
        """The stream for the VLM batch: a green context with the lockstep's SM count."""
        if share >= 1.0 or not self._green_supported:
            return self.full_stream
        sms = self.vlm_sms(share)
        if sms not in self._green:  # created once per SM count, reused at every lockstep
            # lazy: CUDA green contexts exist only on a GPU
            from torch.cuda.green_contexts import GreenContext

            # torch annotates create() with its CPU-build placeholder base (object); on a CUDA build
            # it returns the green context, whose Stream() is used here
            ctx = cast(GreenContext, GreenContext.create(num_sms=sms, device_id=self.device.index))
            self._green[sms] = (ctx, ctx.Stream())
        return self._green[sms][1]

    def run(self, plan: LockstepPlan, policies: Mapping[str, VlaPolicy]) -> LockstepTiming:
        start = torch.cuda.Event(enable_timing=True)
        v_end, a_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if plan.sequential:
            assert plan.vlm is not None and plan.adit is not None  # sequential: both stages, same requests
            with torch.cuda.stream(self.full_stream):
                start.record()
                run_vlm_batch(policies[plan.vlm.model], plan.vlm)
                run_adit_batch(policies[plan.adit.model], plan.adit)
                v_end.record()
            self.full_stream.synchronize()
            ms = start.elapsed_time(v_end)
            return LockstepTiming(ms, 0.0, ms, self.total_sms, 0)
        vs = self.vlm_stream(plan.vlm_share if plan.adit else 1.0)
        start.record(torch.cuda.current_stream(self.device))
        for s in (vs, self.adit_stream):
            s.wait_event(start)
        if plan.vlm:  # launched first: its kernels are queued asynchronously
            with torch.cuda.stream(vs):
                run_vlm_batch(policies[plan.vlm.model], plan.vlm)
                v_end.record()
        if plan.adit:
            with torch.cuda.stream(self.adit_stream):
                for r in plan.adit.requests:  # produced on another stream in an earlier lockstep
                    r.prefix.features.record_stream(self.adit_stream)
                    r.prefix.mask.record_stream(self.adit_stream)
                run_adit_batch(policies[plan.adit.model], plan.adit)  # ends with a host copy
                a_end.record()
        vs.synchronize()
        self.adit_stream.synchronize()
        vlm_ms = start.elapsed_time(v_end) if plan.vlm else 0.0
        adit_ms = start.elapsed_time(a_end) if plan.adit else 0.0
        sms = self.vlm_sms(plan.vlm_share) if vs is not self.full_stream else self.total_sms
        return LockstepTiming(
            vlm_ms, adit_ms, max(vlm_ms, adit_ms), sms if plan.vlm else 0, self.total_sms if plan.adit else 0
        )

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
