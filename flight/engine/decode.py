"""The decode phase: greedy, one token per step, a decode record every D steps.

After a reboot in decode the first step runs layer group by layer group inside the prefill
plan's executor (`first_step_group`, a `StepOp` of flight/recovery/phases.py), each group as
soon as its weights and KV are read, so the step ends right after the last read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from common.record import Record
from flight.checkpoint.store import Frontier
from flight.events import EngineEvent
from flight.recovery.phases import StepOp

from .context import LanguageState, RequestContext
from .int8 import dequantize, quantize


@dataclass
class DecodeRestart:
    """Where a restart in decode stands, and its first step while it runs group by group."""

    records: list[Record]  # the decode records found, oldest first
    tokens: list[int]  # the first token and every token the records hold
    step: int  # the durable step: decode steps done
    # The request had already produced all its tokens: the first step redoes the last one, whose
    # logits never reached RESULT.
    finished: bool
    logits: torch.Tensor | None = None  # the first step's, once its last group ran
    started: float = 0.0  # when the first step began (perf_counter), for the cadence
    # The first step's inputs, set by its first group and used by the others.
    text_positions: torch.Tensor | None = None
    mask: object = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden: torch.Tensor | None = None  # between one group and the next


class DecodePhase:
    def __init__(self, request: RequestContext, state: LanguageState):
        self.request = request
        self.state = state
        self.eos = set(request.model.eos_token_ids)
        self.restart: DecodeRestart | None = None  # set by the prefill plan when decode records exist
        self.tokens: list[int] = []
        self.durable_step = 0  # steps covered by records handed to the writer that reached the disk

    # ---- restart ----------------------------------------------------------------------------------
    def plan_restart(self, frontier: Frontier) -> DecodeRestart:
        """Where a restart in decode stands: the tokens of the decode records, the durable step,
        and whether the request had already produced all its tokens."""
        tokens = [int(frontier.decode_records[0].meta["first_token"])]
        for record in frontier.decode_records:
            tokens += record.tensors["tokens"].tolist()
        finished = len(tokens) >= self.request.max_new_tokens or tokens[-1] in self.eos
        self.restart = DecodeRestart(list(frontier.decode_records), tokens, len(tokens) - 1, finished)
        return self.restart

    def first_step_group(self, op: StepOp) -> None:
        """The restart's first decode step through layer group `op.group`, once that group's
        weights and KV are in (PhaseExecutor orders it): its prefill KV and the decode records'
        KV join the cache, then its layers run."""
        request, adapter, state = self.request, self.request.adapter, self.state
        restart = self.restart
        assert restart is not None, "a decode step op without a decode restart"
        first, end = request.layer_groups[op.group]
        for layer in range(first, end):
            state.extend_kv(layer, len(request.token_chunks))
            cache_layer = state.cache_layer(layer)
            for record in restart.records:
                keys, values = (
                    dequantize(record.tensors, f"{kind}.{layer}", cache_layer.keys.dtype) for kind in ("k", "v")
                )
                cache_layer.keys = torch.cat([cache_layer.keys, keys.to(request.device)], dim=-2)
                cache_layer.values = torch.cat([cache_layer.values, values.to(request.device)], dim=-2)
            if restart.finished:
                cache_layer.keys, cache_layer.values = cache_layer.keys[:, :, :-1], cache_layer.values[:, :, :-1]
        if op.group == 0:
            request.pacer.begin()
            restart.started = time.perf_counter()
            step = restart.step - 1 if restart.finished else restart.step
            position = request.prompt_tokens + step
            hidden = adapter.embed(torch.tensor([[restart.tokens[step]]], device=request.device))
            restart.text_positions = torch.tensor([[position]], device=request.device)
            mrope = (restart.text_positions + request.positions.rope_deltas.to(request.device))[None].expand(3, 1, 1)
            # The mask looks at layer 0's cache only, which is complete now (as in `step`).
            restart.mask = adapter.mask(
                hidden,
                torch.ones(1, position + 1, dtype=torch.long, device=request.device),
                state.cache,
                restart.text_positions,
            )
            restart.rope = adapter.rotary(hidden, mrope)
        else:
            assert restart.hidden is not None, "decode step groups run in order"
            hidden, restart.hidden = restart.hidden, None
        for layer in range(first, end):
            request.model.weights.ensure(*adapter.layer_modules(layer))
            hidden = adapter.layer(layer, hidden, restart.mask, restart.text_positions, state.cache, restart.rope)
        if op.group == len(request.layer_groups) - 1:
            request.model.weights.ensure(*adapter.head_modules())
            restart.logits = adapter.logits(hidden)
            request.pacer.end()
        else:
            restart.hidden = hidden

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, frontier: Frontier) -> tuple[list[int], torch.Tensor, str] | None:
        """Decode to the end: (tokens, the last step's logits, finish reason); None when the run
        stops at a step boundary."""
        request, adapter, state, records = self.request, self.request.adapter, self.state, self.request.records
        started = time.perf_counter()
        max_new_tokens, geometry = request.max_new_tokens, request.geometry
        request.model.weights.ensure(*adapter.head_modules())
        logits: torch.Tensor | None = None
        pending: DecodeRestart | None = None
        if frontier.decode_records:
            # The restart's first step already ran, layer group by layer group, behind the reads
            # (first_step_group); its KV and the decode records' are in the cache.
            restart = self.restart
            assert restart is not None
            tokens, step = list(restart.tokens), restart.step
            self.durable_step = step
            request.store.prepare_decode_log(frontier.decode_log_end)
            request.events(EngineEvent.DECODE_RESTORED, step=step)
            if restart.finished:
                # Finished, but the final logits never reached RESULT: the step redid the last one.
                tokens.pop()
                logits = restart.logits
                assert logits is not None
                tokens.append(int(logits.argmax(-1)))
            else:
                pending = restart
        else:
            request.store.prepare_decode_log(0)
            self.durable_step = 0
            logits = adapter.logits(state.hidden.pop((len(request.layer_groups) - 1, len(request.token_chunks) - 1)))
            tokens, step = [int(logits.argmax(-1))], 0
        state.hidden.clear()
        self.tokens = tokens
        submitted = step
        while len(tokens) < max_new_tokens and tokens[-1] not in self.eos:
            if pending is not None:  # computed (and paced) during the restart's reads
                logits, unit_start, pending = pending.logits, pending.started, None
            else:
                request.pacer.begin()
                unit_start = time.perf_counter()
                logits = self.step(tokens[-1], request.prompt_tokens + step)
                request.pacer.end()
            assert logits is not None
            tokens.append(int(logits.argmax(-1)))
            step += 1
            request.cadence.observe_unit("decode", time.perf_counter() - unit_start)
            if request.unit_done(EngineEvent.DECODE_STEP_DONE, step=step, of=max_new_tokens - 1):
                return None  # the run ends at this boundary: no record of this step
            finished = len(tokens) >= max_new_tokens or tokens[-1] in self.eos
            if finished:
                continue  # the final step is covered by RESULT, which also holds its logits
            urgent = request.checkpoint_requested()
            if urgent or request.policy.decode_record_due(step - submitted, geometry, finished):
                request.checkpoint_soon.clear()
                records.submit(f"decode[..{step}]", self.write_record, step, phase="decode")
                submitted = step
            elif records.early("decode", step - submitted, geometry.decode_every):
                # Optional: a record covers every step since the last durable one, so one the
                # busy writer drops is covered by the next.
                if records.submit(f"decode[..{step}]", self.write_record, step, optional=True, phase="decode"):
                    submitted = step
        request.phase_seconds["decode"] += time.perf_counter() - started
        records.note_held_peak("decode")
        assert logits is not None
        finish = "eos" if tokens[-1] in self.eos else "length"
        return tokens, logits, finish

    def step(self, token: int, position: int) -> torch.Tensor:
        """One decode step through every layer: the next token's logits."""
        request, adapter, cache = self.request, self.request.adapter, self.state.cache
        hidden = adapter.embed(torch.tensor([[token]], device=request.device))
        text_positions = torch.tensor([[position]], device=request.device)
        mrope = (text_positions + request.positions.rope_deltas.to(request.device))[None].expand(3, 1, 1)
        mask = adapter.mask(
            hidden, torch.ones(1, position + 1, dtype=torch.long, device=request.device), cache, text_positions
        )
        rope = adapter.rotary(hidden, mrope)
        for layer in range(adapter.num_layers):
            request.model.weights.ensure(*adapter.layer_modules(layer))
            hidden = adapter.layer(layer, hidden, mask, text_positions, cache, rope)
        return adapter.logits(hidden)

    def write_record(self, step_end: int) -> int:
        """Runs on the writer: one record covering every step since the last record that reached
        the disk (so a record skipped for a full disk leaves no gap). Slices are taken now from
        the cache, whose tensors are replaced, never modified, as decoding goes on."""
        request = self.request
        step_start, prompt_tokens = self.durable_step, request.prompt_tokens
        start, end = prompt_tokens + step_start, prompt_tokens + step_end
        # (keys, values) per layer: tensors, or int8 values with their scales (int8.py)
        kv: dict[int, tuple[Any, Any]] = {}
        for layer in range(request.adapter.num_layers):
            cache_layer = self.state.cache_layer(layer)
            kv[layer] = (
                cache_layer.keys[:, :, start:end].clone(memory_format=torch.contiguous_format),
                cache_layer.values[:, :, start:end].clone(memory_format=torch.contiguous_format),
            )
        meta = {
            "step_start": step_start,
            "step_end": step_end,
            "pos_start": start,
            "pos_end": end,
            "first_token": self.tokens[0],
        }
        new_tokens = torch.tensor(self.tokens[step_start + 1 : step_end + 1], dtype=torch.int64)
        if request.options.decode_kv_compression == "int8":
            kv = {layer: (quantize(keys), quantize(values)) for layer, (keys, values) in kv.items()}
        nbytes = request.store.append_decode(meta, kv, new_tokens)
        self.durable_step = step_end
        return nbytes
