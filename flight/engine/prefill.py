"""The prefill phase's blocks: the prompt in chunks of C tokens x decoder layers in groups of G.

Each block (group g, chunk c) runs G layers on C tokens once the KV of chunks < c of its layers
is in the cache (computed, or read and joined there) and its input hidden state is at hand (the
previous group's output, or the chunk's embeddings for group 0). The recovery plan
(restore.py) decides which blocks run, which records are read, and in what order; the
functions here are its read and compute callbacks.
"""

from __future__ import annotations

import torch

from flight.checkpoint.store import BlockInfo
from flight.events import EngineEvent
from flight.recovery.plan import ComputeOp, ReadOp

from .context import LanguageState, RequestContext
from .pacing import REPROJECT_PACE_UNITS
from .vision import VisionPhase


class PrefillBlocks:
    def __init__(self, request: RequestContext, state: LanguageState, vision: VisionPhase):
        self.request = request
        self.state = state
        self.vision = vision
        self.scheduled: set[tuple[int, int]] = set()  # blocks the current plan computes
        self.blocks_done = 0  # for progress reports: blocks restored or computed so far

    # ---- reads ------------------------------------------------------------------------------------
    def read(self, op: ReadOp, blocks: dict[tuple[int, int], BlockInfo]) -> int:
        """One read of the plan (`blocks`: the records found); the bytes it read."""
        request, state = self.request, self.state
        if op.what == "weights":
            first, end = request.layer_groups[op.group]
            adapter = request.adapter
            modules = (adapter.embed_modules() if op.group == 0 else []) + [
                module for layer in range(first, end) for module in adapter.layer_modules(layer)
            ]
            if op.group == len(request.layer_groups) - 1:
                modules += adapter.head_modules()
            return request.load_weights(*modules)
        info = blocks[(op.group, op.chunk)]
        tensors = request.store.read_block(info, {op.what})
        if op.what == "kv":
            for layer in range(*info.layers):
                state.read_kv[(layer, op.chunk)] = (
                    tensors[f"k.{layer}"].to(request.device),
                    tensors[f"v.{layer}"].to(request.device),
                )
            return info.kv_bytes
        state.hidden[(op.group, op.chunk)] = tensors["hidden"].to(request.device)
        return info.hidden_bytes

    # ---- compute ----------------------------------------------------------------------------------
    def embed_chunk(self, chunk: int) -> torch.Tensor | None:
        """Token embeddings of a chunk, with the merged visual tokens at visual positions; None
        when the run stopped inside the vision phase this chunk needed."""
        request, positions = self.request, self.request.positions
        start, end = request.token_chunks[chunk]
        request.model.weights.ensure(*request.adapter.embed_modules())
        hidden = request.adapter.embed(request.inputs.input_ids[:, start:end].to(request.device))
        visual = positions.visual_mask[:, start:end]
        if bool(visual.any()):
            rows = positions.visual_rows[start:end][visual[0]]
            vision = self.vision.out()
            if vision is None:
                return None
            embeds = vision["embeds"][rows].to(hidden.dtype)
            hidden = hidden.masked_scatter(visual[..., None].expand_as(hidden), embeds)
        return hidden

    def _block_input(self, group: int, chunk: int) -> torch.Tensor | None:
        return self.embed_chunk(chunk) if group == 0 else self.state.hidden.pop((group - 1, chunk))

    def reproject(self, op: ComputeOp) -> None:
        """Rebuild a block's KV from its input hidden state (records that hold no KV)."""
        request, adapter = self.request, self.request.adapter
        group, chunk = op.group, op.chunk
        (first, end), (start, stop) = request.layer_groups[group], request.token_chunks[chunk]
        if end - first != 1:
            raise RuntimeError("KV re-projection needs one layer per block (G = 1)")
        request.pacer.begin()
        request.model.weights.ensure(*adapter.layer_modules(first))
        hidden = self._block_input(group, chunk)
        if hidden is None:
            return  # the run stopped inside the vision phase this block needed
        rope = adapter.rotary(hidden, request.positions.mrope(start, stop))
        self.state.read_kv[(first, chunk)] = adapter.reproject_kv(
            first, hidden, request.positions.text(start, stop), rope
        )
        request.pacer.end(units=REPROJECT_PACE_UNITS)

    def compute(self, op: ComputeOp) -> None:
        """Run block (group, chunk) and hand what the policy keeps of it to the writer."""
        request, adapter, state, positions = self.request, self.request.adapter, self.state, self.request.positions
        request.pacer.begin()
        group, chunk = op.group, op.chunk
        (first, end), (start, stop) = request.layer_groups[group], request.token_chunks[chunk]
        request.model.weights.ensure(
            *[module for layer in range(first, end) for module in adapter.layer_modules(layer)]
        )
        for layer in range(first, end):
            state.extend_kv(layer, chunk)
        hidden = self._block_input(group, chunk)
        if hidden is None:
            return  # the run stopped inside the vision phase this block needed
        text_positions = positions.text(start, stop)
        attention_mask = torch.ones(1, stop, dtype=torch.long, device=request.device)
        mask = adapter.mask(hidden, attention_mask, state.cache, text_positions, layer_idx=first)
        rope = adapter.rotary(hidden, positions.mrope(start, stop))
        visual = positions.visual_mask[:, start:stop]
        rows = positions.visual_rows[start:stop][visual[0]]
        layer_inputs = {}
        for layer in range(first, end):
            if request.policy.layer_input_hidden():
                layer_inputs[layer] = hidden
            hidden = adapter.layer(layer, hidden, mask, text_positions, state.cache, rope)
            if layer < adapter.deepstack_layers:
                deepstack = None
                if bool(visual.any()):
                    vision = self.vision.out()
                    if vision is None:
                        return  # the run stopped inside the vision phase this block needed
                    deepstack = vision[f"deepstack.{layer}"][rows]
                hidden = adapter.after_layer(layer, hidden, visual, deepstack)
        state.kv_chunks[first:end] = [chunk + 1] * (end - first)
        last_block = (len(request.layer_groups) - 1, len(request.token_chunks) - 1)
        if (group + 1, chunk) in self.scheduled or (group, chunk) == last_block:
            state.hidden[(group, chunk)] = hidden
        request.pacer.end(units=end - first)
        self.blocks_done += 1
        if request.unit_done(
            EngineEvent.PREFILL_BLOCK_DONE, group=group, chunk=chunk, done=self.blocks_done, of=request.num_blocks
        ):
            return  # the run ends at this boundary: nothing of this block is kept
        self._persist(group, chunk, hidden, layer_inputs)

    def _persist(self, group: int, chunk: int, hidden: torch.Tensor, layer_inputs: dict[int, torch.Tensor]) -> None:
        request, cache = self.request, self.state.cache
        (first, end), (start, stop) = request.layer_groups[group], request.token_chunks[chunk]
        persist = request.policy.prefill_block(group, chunk, len(request.layer_groups), len(request.token_chunks))
        if persist is not None:

            def copy_block():  # called once the writer has room for one more record
                kv = (
                    {
                        layer: (
                            cache.layers[layer].keys[:, :, start:stop].clone(memory_format=torch.contiguous_format),
                            cache.layers[layer].values[:, :, start:stop].clone(memory_format=torch.contiguous_format),
                        )
                        for layer in range(first, end)
                    }
                    if persist.kv
                    else {}
                )
                return group, chunk, (first, end), (start, stop), kv, hidden if persist.boundary_hidden else None

            request.records.submit(f"prefill[g{group},c{chunk}]", request.store.put_prefill_block, make_args=copy_block)
        for layer, layer_input in layer_inputs.items():
            request.records.submit(
                f"hidden[l{layer},c{chunk}]", request.store.put_layer_hidden, layer, chunk, (start, stop), layer_input
            )
