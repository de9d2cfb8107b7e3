"""The prefill phase as a recovery plan: which blocks to read, which to compute, in what order.

A fresh run and a restart are the same code: the plan of an empty frontier computes every
block. The plan (flight/recovery/plan.py, chosen by the policy) is run by `PhaseExecutor`, which
overlaps its reads with its computes and calls back into `PrefillBlocks` (reads, blocks,
re-projections), `VisionPhase` (the vision.out read) and `DecodePhase` (a decode restart's first
step, group by group). A record that fails its checks mid-plan is quarantined and the plan is
made again from a new scan of the directory, at most `MAX_REPLANS` times.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import replace
from typing import cast

from common.durable import read_rate_of
from flight.checkpoint.policies import Policy
from flight.checkpoint.store import BlockInfo, Frontier
from flight.events import EngineEvent
from flight.options import EngineOptions
from flight.recovery.executor import RecordRejected
from flight.recovery.phases import VISION_OUT, PhaseExecutor, StepOp, needs_vision_out, vision_groups
from flight.recovery.plan import ComputeOp, ReadOp, RecoveryProblem, make_plan

from .context import LanguageState, RequestContext
from .decode import DecodePhase
from .pacing import paced_block_costs
from .prefill import PrefillBlocks
from .vision import VisionPhase

MAX_REPLANS = 8


def restart_planner(policy: Policy, options: EngineOptions, frontier: Frontier, num_blocks: int) -> str:
    """The planner a restart from `frontier` plans its prefill with, as `PrefillRestore.run`
    first chooses it: the policy's, except that a decode restart with every block's KV stored
    reads them layer-first (its first step needs the groups in order); "none" when the RESULT is
    there already (nothing to plan)."""
    if frontier.result is not None:
        return "none"
    planner, overlap = policy.recovery(options.planner, options.overlap_recovery)
    operator_planner = (planner, overlap) == (options.planner, options.overlap_recovery)
    complete = len(frontier.blocks) == num_blocks and all(info.kv_bytes for info in frontier.blocks.values())
    if operator_planner and frontier.decode_records and complete:
        return "layer-first"
    return planner


class PrefillRestore:
    def __init__(
        self,
        request: RequestContext,
        state: LanguageState,
        vision: VisionPhase,
        blocks: PrefillBlocks,
        decode: DecodePhase,
    ):
        self.request = request
        self.state = state
        self.vision = vision
        self.blocks = blocks
        self.decode = decode
        self.plan_summary: dict | None = None  # the last plan's, with its execution times
        positions = request.positions
        self.visual_chunks = frozenset(
            chunk
            for chunk, (start, end) in enumerate(request.token_chunks)
            if bool(positions.visual_mask[0, start:end].any())
        )
        self.vision_groups = vision_groups(request.layer_groups, request.adapter.deepstack_layers)

    def run(self, frontier: Frontier) -> Frontier | None:
        """Restore or compute every prefill block (and a decode restart's first step); the
        frontier the plan that succeeded was made from, or None when the run stopped at a unit
        boundary inside the plan."""
        request, options = self.request, self.request.options
        have_decode = bool(frontier.decode_records)
        for _attempt in range(MAX_REPLANS):
            problem = RecoveryProblem(
                len(request.layer_groups),
                len(request.token_chunks),
                set(frontier.blocks),
                {block for block, info in frontier.blocks.items() if info.has_hidden},
                need_last_hidden=not have_decode,
                kv_missing={block for block, info in frontier.blocks.items() if info.kv_bytes == 0},
            )
            planner, overlap = request.policy.recovery(options.planner, options.overlap_recovery)
            operator_planner = (planner, overlap) == (options.planner, options.overlap_recovery)
            if not frontier.blocks:  # nothing to restore: weights stream behind the compute, as in any fresh run
                overlap = options.overlap_recovery
            if operator_planner and have_decode and not problem.must_compute() and not problem.reprojections():
                # A decode restart: its first step needs the layer groups in order, each with its
                # weights and all its KV -- exactly layer-first's reads. (Baselines keep their own.)
                planner = "layer-first"
            elif planner == "optimal":
                problem.costs = self._plan_costs()
            plan = make_plan(planner, problem)
            self.blocks.scheduled = {(op.group, op.chunk) for op in plan.computes}
            # for progress reports: the blocks this plan does not compute count as done
            self.blocks.blocks_done = request.num_blocks - sum(op.kind == "block" for op in plan.computes)
            if (
                self.vision.output is None
                and frontier.vision_done
                and any(needs_vision_out(op, self.vision_groups, self.visual_chunks) for op in plan.computes)
            ):
                # read once, first, by the reader: not inside the compute that needs it (a group-0
                # re-projection read it there, on the compute thread, until 2026-12: 3 MB through
                # the testbench's throttle, 10 trace s of every HCache restore, unplanned)
                plan.reads.insert(0, VISION_OUT)
            summary = plan.summary()
            summary["vision_out_read"] = VISION_OUT in plan.reads
            summary["costs"] = problem.costs.get("source") if problem.costs else None  # what it planned with
            self.plan_summary = summary
            self.decode.restart = None
            if have_decode:
                restart = self.decode.plan_restart(frontier)
                # PhaseExecutor takes a StepOp where a ComputeOp goes (same group/chunk/kind fields).
                steps = cast(list[ComputeOp], [StepOp(group) for group in range(len(request.layer_groups))])
                plan.computes = plan.computes + steps
                request.phase_plans["decode"] = {
                    "step": restart.step,
                    "planner": planner,
                    "reads": len(plan.reads),
                    "groups": len(request.layer_groups),
                }
            if frontier.blocks:
                stored = Counter(group for group, _ in frontier.blocks)
                # what the payload's log keeps of a restart: what was found (stored blocks per
                # layer group, whether vision.out was durable) and what the plan does first
                request.events(
                    EngineEvent.RECOVERY_PLAN,
                    **summary,
                    stored_by_group=[stored[g] for g in range(len(request.layer_groups))],
                    vision_out_durable=frontier.vision_done,
                    first_computes=[f"{op.kind} g{op.group} c{op.chunk}" for op in plan.computes[:3]],
                )
            started = time.perf_counter()
            executor = PhaseExecutor(
                plan,
                functools.partial(self._read, blocks_found=frontier.blocks),
                self._compute,
                overlap=overlap,
                visual_chunks=self.visual_chunks,
                vision_groups=self.vision_groups,
                num_chunks=len(request.token_chunks),
                halted=lambda: request.stopped is not None,
            )
            try:
                stats = executor.run()
            except RecordRejected as exc:
                info = frontier.blocks.get((exc.op.group, exc.op.chunk))
                if info is not None:
                    request.store.quarantine(info.path, exc.error.reason)
                frontier = request.store.scan()
                have_decode = bool(frontier.decode_records)
                self.state.reset()
                continue
            if stats.halted:
                return None
            request.phase_seconds["prefill"] += time.perf_counter() - started
            if have_decode:
                request.phase_plans["decode"].update(
                    read_s=round(stats.read_seconds, 6),
                    stall_s=round(stats.stall_seconds, 6),
                    wall_s=round(stats.wall_seconds, 6),
                    bytes_read=stats.bytes_read,
                )
            request.records.note_held_peak("prefill")
            summary.update(
                read_s=round(stats.read_seconds, 6),
                compute_s=round(stats.compute_seconds, 6),
                stall_s=round(stats.stall_seconds, 6),
                wall_s=round(stats.wall_seconds, 6),
                bytes_read=stats.bytes_read,
            )
            if frontier.blocks:
                request.events(
                    EngineEvent.PREFILL_RESTORED,
                    stall_s=round(stats.stall_seconds, 4),
                    read_s=round(stats.read_seconds, 4),
                    bytes_read=stats.bytes_read,
                )
            return frontier
        raise RuntimeError("recovery could not find a consistent set of records")

    def _plan_costs(self) -> dict:
        """Costs for the optimal planner: the cost model the engine was handed, with each read at
        the bandwidth it really gets -- checkpoint records at the storage's (possibly throttled,
        target-emulating) rate, the weights at their own read hook's (`read_rate_of`: the
        testbench reads them unthrottled, the recovery bench through the checkpoint throttle) --
        and compute at least the pace where the payload is paced (`paced_block_costs`).

        Charging unthrottled weights at the checkpoint throttle's rate made every group's weights
        look like a minute of reading on the testbench: every group order then met the same
        read-bound makespan, and the plan flown was whichever near-tie a 1e-6 difference in the
        costs favoured (docs/recovery.md, "Costs of a paced payload")."""
        request = self.request
        model = request.cost_model()
        read_rate = request.store.fs.emulated_read_rate()
        checkpoints = replace(model, read_bytes_per_s=read_rate) if read_rate is not None else model
        costs = checkpoints.block_costs(request.layer_groups, request.token_chunks)
        weight_rate = read_rate_of(request.model.weights.read_hook)
        weights = replace(model, read_bytes_per_s=weight_rate) if weight_rate is not None else model
        costs = replace(
            costs,
            weights=weights.weights_read_s(request.layer_groups),
            source=f"{costs.source}, weights at {weights.read_bytes_per_s / 1e6:g} MB/s",
        )
        if request.options.pace_ms > 0:
            costs = paced_block_costs(costs, request.layer_groups, request.options.pace_ms / 1000.0)
        return costs.as_dict()

    # ---- the executor's callbacks -------------------------------------------------------------
    def _read(self, op: ReadOp, blocks_found: dict[tuple[int, int], BlockInfo]) -> int:
        if op.what == VISION_OUT.what:
            return self.vision.read_out()
        return self.blocks.read(op, blocks_found)

    def _compute(self, op: ComputeOp | StepOp) -> None:
        if op.kind == "decode":
            assert isinstance(op, StepOp)
            self.decode.first_step_group(op)
        elif op.kind == "reproject":
            assert isinstance(op, ComputeOp)
            self.blocks.reproject(op)
        else:
            assert isinstance(op, ComputeOp)
            self.blocks.compute(op)
