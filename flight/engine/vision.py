"""The vision phase: vision blocks 0..V-1 one at a time, then the merger.

Its output (merged visual tokens and DeepStack features) is computed once, or read from
`vision.out`, when the first prefill block with visual tokens needs it. After a reboot inside
the vision phase its reads (the newest vision state, then weights in the order the blocks need
them) run ahead of the compute on one thread (flight/recovery/phases.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from flight.checkpoint.store import Frontier
from flight.checkpoint.writer import state_bytes
from flight.events import EngineEvent
from flight.recovery.phases import ReadAhead

from .context import RequestContext
from .records import tensor_bytes


class VisionPhase:
    def __init__(self, request: RequestContext, frontier: Frontier):
        self.request = request
        self.frontier = frontier  # as found at open: which vision records exist
        self.output: dict[str, torch.Tensor] | None = None
        self.reads: ReadAhead | None = None

    # ---- reads ahead of the compute -------------------------------------------------------------
    def start_reads(self) -> None:
        """The vision phase's reads in the order it needs them: the newest vision state, the
        weights of the blocks still to run, the merger, then the language model's weights layer
        by layer for the prefill that follows."""
        request, adapter, start = self.request, self.request.adapter, self.frontier.vision_block
        reads: list[tuple[str, Callable[[], tuple[object, int]]]] = []
        if start:
            reads.append(("vision.state", self._read_state))
        modules = adapter.vision_prologue_modules() + [
            module
            for block in range(start, adapter.num_vision_blocks)
            for module in adapter.vision_block_modules(block)
        ]
        for module in modules + adapter.vision_epilogue_modules() + adapter.all_lm_modules():
            reads.append((module, functools.partial(self._read_weights, module)))
        if start:
            request.phase_plans["vision"] = {
                "resume_block": start,
                "reads": len(reads),
                "order": [name for name, _ in reads],
            }
            request.events(EngineEvent.RECOVERY_PLAN, phase="vision", block=start, reads=len(reads))
        self.reads = ReadAhead(reads).start()

    def _read_state(self) -> tuple[object, int]:
        record = self.request.store.read_vision_state(self.frontier)
        return record, tensor_bytes(record)

    def _read_weights(self, module: str) -> tuple[object, int]:
        return None, self.request.load_weights(module)

    def stop_reads(self) -> None:
        """From here on one read stream is the prefill plan's: the vision phase's reads stop."""
        if self.reads is not None:
            self.reads.stop()
            if "vision" in self.request.phase_plans:
                self.request.phase_plans["vision"].update(self.reads.summary())
            self.reads = None
        self.request.model.weights.stop_prefetch()

    # ---- the output prefill needs -----------------------------------------------------------------
    def out(self) -> dict[str, torch.Tensor] | None:
        """Merged visual tokens and DeepStack features: computed, or read from vision.out, once;
        None when the run stops at a boundary of the vision blocks this computes (the caller
        returns at once: RequestContext.stopped is set).

        Needed by prefill blocks of the first layers; after a reboot in prefill or decode it is
        only read if some such block has to be recomputed."""
        if self.output is None and self.request.stopped is None:
            request = self.request
            if request.inputs.image_grid_thw.shape[0] == 0:
                self.output = {
                    "embeds": torch.zeros(
                        0, request.adapter.text_config.hidden_size, device=request.device, dtype=request.model.dtype
                    )
                }
            else:
                record = request.store.read_vision_out() if self.frontier.vision_done else None
                if record is not None:
                    self.output = {name: t.to(request.device) for name, t in record.tensors.items()}
                else:
                    self.output = self.run()
        return self.output

    def read_out(self) -> int:
        """The prefill plan's read of vision.out; 0 bytes when the record was damaged (quarantined):
        the block that needs it recomputes the vision phase."""
        record = self.request.store.read_vision_out()
        if record is None:
            return 0
        self.output = {name: t.to(self.request.device) for name, t in record.tensors.items()}
        return tensor_bytes(record)

    # ---- the blocks -------------------------------------------------------------------------------
    def run(self) -> dict[str, torch.Tensor] | None:
        """The vision blocks from the newest vision state (or the start), then the merger; None
        when the run stops at a block boundary."""
        request, adapter = self.request, self.request.adapter
        records, geometry, policy = request.records, request.geometry, request.policy
        started = time.perf_counter()
        num_blocks = adapter.num_vision_blocks
        request.model.weights.ensure(*adapter.vision_prologue_modules())
        context = adapter.vision_context(request.inputs.image_grid_thw, request.device)
        start, side = 0, {}
        record = None
        if self.frontier.vision_block:
            reads = self.reads
            record = (
                reads.result("vision.state") if reads is not None else request.store.read_vision_state(self.frontier)
            )
        if record is not None:
            start = int(record.meta["block"])
            hidden = record.tensors["hidden"].to(request.device)
            side = {name: t.to(request.device) for name, t in record.tensors.items() if name != "hidden"}
            request.events(EngineEvent.VISION_RESTORED, block=start)
        else:
            pixels = request.inputs.pixels()
            if pixels is None:  # not to be had now (an image to be sent again): the run ends here
                request.await_inputs()
                return None
            hidden = adapter.vision_embed(context, pixels.to(request.device))
        # the newest vision state handed to the writer, states dropped since, and whether that
        # newest one was an early (adaptive) record
        last_state, deferred, last_early = start, 0, False
        for block in range(start, num_blocks):
            request.pacer.begin()
            unit_start = time.perf_counter()
            request.model.weights.ensure(*adapter.vision_block_modules(block))
            hidden, extra = adapter.vision_block(context, block, hidden)
            side.update(extra)
            request.pacer.end()
            request.cadence.observe_unit("vision", time.perf_counter() - unit_start)
            done = block + 1
            if request.unit_done(EngineEvent.VISION_BLOCK_DONE, block=done, of=num_blocks):
                return None
            urgent = done < num_blocks and request.checkpoint_requested()
            scheduled = policy.vision_state_due(done, num_blocks, geometry)
            # The adaptive cadence skips a scheduled state whose write would outlast both the
            # phase and the work it saves (Cadence.skip_vision_state); never one the bus asked for.
            skipped = (
                scheduled
                and not urgent
                and done < num_blocks
                and records.skips_vision_state(done, done - last_state, num_blocks - done, state_bytes((hidden, side)))
            )
            scheduled = scheduled and not skipped
            early = (
                not scheduled
                and not skipped
                and done < num_blocks
                and records.early("vision", done - last_state, geometry.vision_every)
            )
            if urgent or scheduled or early:
                request.checkpoint_soon.clear()
                # A cadence checkpoint is dropped while the previous record is still being
                # written (the next one supersedes it); one the bus asked for is not, and
                # neither is one after a dropped one: progress never waits on an idle writer
                # forever, and a window that can only write every other state still keeps one.
                # Nor is a scheduled one dropped for an early one still being written: early
                # records only add to the fixed cadence (skips are the rule's, above).
                kept = records.submit(
                    f"vision.state[{done}]",
                    request.store.put_vision_state,
                    done,
                    hidden,
                    dict(side),
                    optional=not urgent and deferred == 0 and not (scheduled and last_early),
                    phase="vision",
                )
                if kept:
                    last_state, deferred, last_early = done, 0, early
                else:
                    deferred += 1
        request.model.weights.ensure(*adapter.vision_epilogue_modules())
        embeds = adapter.vision_finish(context, hidden)
        if policy.persist_vision_out() and records.enabled:
            # Written behind the prefill blocks that follow (it is large, and its tensors stay in
            # memory for the whole prefill anyway); the vision states go only once it is durable.
            records.writer.submit_background("vision.out", self._persist_out, embeds, dict(side))
        request.phase_seconds["vision"] += time.perf_counter() - started
        records.note_held_peak("vision")
        return {"embeds": embeds, **side}

    def _persist_out(self, embeds: torch.Tensor, side: dict[str, torch.Tensor], between_slices=None) -> int:
        store = self.request.store
        nbytes = store.put_vision_out(embeds, side, between_slices=between_slices)
        store.remove_vision()
        return nbytes
