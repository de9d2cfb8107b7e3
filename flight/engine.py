"""The resumable VLM engine: one request, three phases, block by block.

    vision   vision blocks 0..V-1 one at a time, then the merger
    prefill  the prompt in chunks of C tokens x decoder layers in groups of G: a grid of blocks
    decode   greedy, one token per step

After every unit of work the checkpoint policy decides what to persist; the writer commits it
off the compute thread. On start the engine reads the request's directory, rebuilds the frontier
(vision block, prefill blocks done, decode step) and continues from there; the prefill part of
that is a recovery plan (flight/recovery/) that overlaps reads with recomputation. A fresh run
is the same code with an empty frontier. Tokens and logits are bitwise those of an
uninterrupted run (tests/engine/).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import transformers
from transformers.cache_utils import DynamicCache

from common.durable import DurableFS, is_disk_full

from .checkpoint.cadence import Cadence
from .checkpoint.policies import Geometry, Policy, get_policy  # noqa: F401  (Geometry: re-exported)
from .checkpoint.store import CheckpointStore, Frontier, OpenOutcome
from .checkpoint.writer import CheckpointWriter
from .model.inputs import RequestInputs
from .model.loader import LoadedModel
from .options import EngineOptions  # noqa: F401  (defined apart so `ow flight run` parses options without torch)
from .recovery.executor import RecordRejected
from .recovery.phases import VISION_OUT, PhaseExecutor, ReadAhead, StepOp
from .recovery.plan import ComputeOp, ReadOp, RecoveryProblem, make_plan

MAX_REPLANS = 8
# Share of a decoder layer's compute that KV re-projection costs (input norm + Q/K/V projections
# of the attention's ~12 GEMM-equivalents per token, for the pace emulation only).
REPROJECT_SHARE = 0.25


class SimulatedCut(Exception):
    """Raised by a test hook to stop a request as a power cut would (nothing after it runs)."""


@dataclass
class Result:
    token_ids: list[int]
    text: str
    logits: torch.Tensor
    finish_reason: str
    resumed: bool
    resumed_from: dict
    bytes_written: int
    phase_seconds: dict
    records_written: int = 0
    records_skipped: int = 0  # lost to a full disk
    records_deferred: int = 0  # optional records dropped while the writer was busy
    # Most tensor bytes that checkpointing kept alive at once, per phase ("vision", "prefill",
    # "decode"; each peak is credited to the next phase to end, which matters only when recovery
    # runs the vision phase inside prefill): what checkpointing adds to peak memory.
    held_state_peak_bytes: dict = field(default_factory=dict)
    write_seconds: float = 0.0  # time the checkpoint writer spent writing (in the background)
    restarted_reason: str | None = None
    plan: dict | None = None
    # What each restarted phase read ahead of its compute ("vision", "decode"; prefill's is `plan`).
    phase_plans: dict = field(default_factory=dict)

    def logits_sha256(self) -> str:
        import hashlib

        return hashlib.sha256(self.logits.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class _Pacer:
    """Stretches each unit of work to at least `ms` milliseconds (demo / testbench emulation).

    The unit is one vision block, one decoder layer on one prefill chunk (a block of G layers
    counts G), or one decode step, so policies with other block shapes take the same emulated
    compute time."""

    def __init__(self, ms: float):
        self.s = ms / 1000.0
        self.start = time.perf_counter()

    def begin(self):
        self.start = time.perf_counter()

    def end(self, units: float = 1.0):
        if self.s > 0:
            left = self.s * units - (time.perf_counter() - self.start)
            if left > 0:
                time.sleep(left)


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        options: EngineOptions | None = None,
        fs: DurableFS | None = None,
        events=None,
        after_commit=None,
        cadence: Cadence | None = None,
    ):
        self.m = model
        self.a = model.adapter
        self.options = options or EngineOptions()
        self.policy: Policy = get_policy(self.options.policy)
        self.geometry = self.policy.geometry(self.options.geometry, self.a.num_layers)
        # What the payload knows about its windows (warnings, telemetry, history); the caller's
        # when it has one (the onboard process), else one that knows only this engine's timings.
        self.cadence = cadence or Cadence(self.options.cadence)
        self.adaptive = self.cadence.mode == "adaptive" and self.policy.name == "orbitweaver"
        self.fs = fs
        self.events = events or (lambda name, **kw: None)
        self.after_commit = after_commit
        # Set from any thread (e.g. on a bus shutdown warning): persist progress at the next unit
        # boundary instead of waiting for the policy's cadence.
        self.checkpoint_soon = threading.Event()
        if self.options.threads:
            torch.set_num_threads(self.options.threads)

    # ------------------------------------------------------------------------------------------
    def manifest(self, inputs: RequestInputs, max_new_tokens: int) -> dict:
        g = self.geometry
        return {
            "model_hash": self.m.content_hash,
            "arch": self.m.model_type,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": str(self.m.dtype).removeprefix("torch."),
            "attn_implementation": self.m.attn_implementation,
            "threads": torch.get_num_threads(),
            "device_type": self.m.device.type,
            "chunk": g.chunk,
            "group": g.group,
            "decode_every": g.decode_every,
            "vision_every": g.vision_every,
            "policy": self.policy.name,
            "inputs_hash": inputs.digest(),
            "max_new_tokens": int(max_new_tokens),
            "decode_kv_compression": self.options.decode_kv_compression,
        }

    def run(self, inputs: RequestInputs, ckpt_dir: str, max_new_tokens: int) -> Result:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        run = _RequestRun(self, inputs, ckpt_dir, max_new_tokens)
        with torch.inference_mode():
            return run.execute()


class _RequestRun:
    """State of one request inside one process lifetime."""

    def __init__(self, engine: Engine, inputs: RequestInputs, ckpt_dir: str, max_new_tokens: int):
        self.e, self.m, self.a = engine, engine.m, engine.a
        self.g = engine.geometry
        self.policy = engine.policy
        self.inputs = inputs
        self.max_new_tokens = max_new_tokens
        self.device = self.m.device
        self.events = engine.events
        self.store = CheckpointStore(ckpt_dir, engine.fs, events=self.events)
        self.writer: CheckpointWriter | None = None
        self.pacer = _Pacer(engine.options.pace_ms)
        self.times = {"restore": 0.0, "vision": 0.0, "prefill": 0.0, "decode": 0.0}
        self.S = inputs.num_tokens
        self.groups = self.g.layer_groups(self.a.num_layers)
        self.chunks = self.g.token_chunks(self.S)
        self.plan_summary = None
        self.phase_plans: dict[str, dict] = {}
        self.held_peaks: dict[str, int] = {}
        self._vision_reads: ReadAhead | None = None

    # ---- top level ----------------------------------------------------------------------------
    def execute(self) -> Result:
        manifest = self.e.manifest(self.inputs, self.max_new_tokens)
        self.checkpoints_enabled = self.policy.writes_checkpoints()
        try:
            outcome = self.store.open(manifest)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            # Not even the MANIFEST fits: run without checkpoints rather than not at all.
            self.events("checkpoint_write_failed", record="MANIFEST", errno=exc.errno, reason=str(exc.strerror))
            self.checkpoints_enabled = False
            outcome = OpenOutcome(0, "no_space", {})
        restarted = None
        if outcome.status in ("mismatch", "unreadable_manifest"):
            restarted = outcome.status
            self.events(
                "manifest_mismatch",
                status=outcome.status,
                differences={k: [str(a), str(b)] for k, (a, b) in outcome.differences.items()}
                if outcome.status == "mismatch"
                else outcome.differences,
            )
        t0 = time.perf_counter()
        frontier = self.store.scan() if self.checkpoints_enabled or outcome.status == "resume" else Frontier()
        self.times["restore"] += time.perf_counter() - t0
        phase = frontier.phase()
        resumed_from = self._describe(frontier, phase)
        self.events(
            "request_opened",
            status=outcome.status,
            **resumed_from,
            prompt_tokens=self.S,
            chunks=len(self.chunks),
            groups=len(self.groups),
        )
        if frontier.result is not None:
            return self._result_from_record(frontier.result, resumed_from)
        # A policy that commits on the compute path (an intermittent-computing task runtime)
        # gets a synchronous writer: each record is durable before the next unit of work.
        asynchronous = self.e.options.async_writes and not self.policy.synchronous_commits()
        self.writer = CheckpointWriter(self.events, asynchronous, self.e.after_commit)
        try:
            tokens, logits, finish = self._run_from(frontier)
            self.writer.drain()
            text = self.m.decode(tokens)
            self._commit_result(tokens, logits, text, finish)
        finally:
            self.writer.close()
        return Result(
            tokens,
            text,
            logits,
            finish,
            resumed=phase != "start",
            resumed_from=resumed_from,
            bytes_written=self.store.bytes_written,
            phase_seconds={k: round(v, 6) for k, v in self.times.items()},
            records_written=self.writer.records_committed,
            records_skipped=self.writer.records_skipped,
            records_deferred=self.writer.records_deferred,
            held_state_peak_bytes=self.held_peaks,
            write_seconds=self.writer.busy_seconds,
            restarted_reason=restarted,
            plan=self.plan_summary,
            phase_plans=self.phase_plans,
        )

    def _describe(self, fr: Frontier, phase: str) -> dict:
        if phase == "done":
            return {"phase": "done", "position": None}
        if phase == "decode":
            return {"phase": "decode", "position": fr.decode_steps}
        if phase == "prefill":
            return {"phase": "prefill", "position": len(fr.blocks), "blocks_total": len(self.groups) * len(self.chunks)}
        if phase == "vision":
            return {"phase": "vision", "position": fr.vision_block}
        return {"phase": "start", "position": 0}

    def _result_from_record(self, rec, resumed_from) -> Result:
        tokens = rec.tensors["token_ids"].tolist()
        return Result(
            tokens,
            rec.meta["text"],
            rec.tensors["logits"].clone(),
            rec.meta["finish_reason"],
            resumed=True,
            resumed_from=resumed_from,
            bytes_written=0,
            phase_seconds={k: 0.0 for k in self.times},
        )

    def _commit_result(self, tokens, logits, text, finish) -> None:
        if self.store.salt == 0:
            return  # no MANIFEST could be written: nothing on disk belongs to this request
        try:
            self.store.put_result(tokens, logits.detach().to("cpu"), text, finish)
            self.store.gc()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.writer.records_skipped += 1
            self.events("checkpoint_write_failed", record="RESULT", errno=exc.errno, reason=str(exc.strerror))
        self.events("request_completed", tokens=len(tokens), finish_reason=finish)

    def _note_held_peak(self, phase: str) -> None:
        self.held_peaks[phase] = max(self.held_peaks.get(phase, 0), self.writer.take_peak())

    def _submit(self, what: str, fn, *args, optional: bool = False, make_args=None, phase: str | None = None) -> bool:
        """Hand a record to the writer; False if it was an optional one the writer dropped.
        `phase`: time the write for the cadence (what a record of this phase costs)."""
        if not self.checkpoints_enabled:
            return False
        if phase is not None:
            fn = self._timed(phase, fn)
        return self.writer.submit(what, fn, *args, optional=optional, make_args=make_args)

    def _timed(self, phase: str, fn):
        cadence = self.e.cadence

        def write(*args):
            start = time.perf_counter()
            n = fn(*args)
            cadence.observe_write(phase, time.perf_counter() - start)
            return n

        return write

    def _early(self, phase: str, since: int, every: int) -> bool:
        """An adaptive-cadence record before the fixed cadence's next one (cadence.py)."""
        return self.e.adaptive and self.checkpoints_enabled and self.e.cadence.early_record(phase, since, every)

    # ---- phases ---------------------------------------------------------------------------------
    def _run_from(self, fr: Frontier):
        self.pos4, self.rope_deltas = self.a.rope_index(
            self.inputs.input_ids, self.inputs.mm_token_type_ids, self.inputs.image_grid_thw
        )
        self.pos4 = self.pos4.to(self.device)
        self.visual_mask = (self.inputs.input_ids == self.a.image_token_id).to(self.device)
        self.visual_rows = self.visual_mask[0].cumsum(0) - 1
        # Reads stream in the order this request needs them, behind the compute.
        needs_vision = (
            not fr.vision_done and not fr.blocks and not fr.decode_records and self.inputs.image_grid_thw.shape[0] > 0
        )
        if needs_vision:
            self._vision_reads = self._plan_vision_reads(fr).start()
        try:
            self._vision_out = None
            self._frontier_at_open = fr
            if not fr.vision_done and not fr.blocks and not fr.decode_records:
                self.vision_out()  # the vision phase is the next work: run it now
            return self._prefill_and_decode(fr)
        finally:
            self._stop_vision_reads()

    def _plan_vision_reads(self, fr: Frontier) -> ReadAhead:
        """The vision phase's reads in the order it needs them (flight/recovery/phases.py): the
        newest vision state, the weights of the blocks still to run, the merger, then the
        language model's weights layer by layer for the prefill that follows."""
        a, start = self.a, fr.vision_block
        reads = []
        if start:

            def state():
                rec = self.store.read_vision_state(fr)
                return rec, _tensor_bytes(rec)

            reads.append(("vision.state", state))
        modules = a.vision_prologue_modules() + [
            m for i in range(start, a.num_vision_blocks) for m in a.vision_block_modules(i)
        ]
        for module in modules + a.vision_epilogue_modules() + a.all_lm_modules():
            reads.append((module, lambda module=module: (None, self._load_weights(module))))
        if start:
            self.phase_plans["vision"] = {
                "resume_block": start,
                "reads": len(reads),
                "order": [name for name, _ in reads],
            }
            self.events("recovery_plan", phase="vision", block=start, reads=len(reads))
        return ReadAhead(reads)

    def _load_weights(self, *modules: str) -> int:
        before = self.m.weights.stats.bytes_read
        self.m.weights.ensure(*modules)
        return self.m.weights.stats.bytes_read - before

    def _stop_vision_reads(self) -> None:
        """From here on one read stream is the prefill plan's: the vision phase's reads stop."""
        if self._vision_reads is not None:
            self._vision_reads.stop()
            if "vision" in self.phase_plans:
                self.phase_plans["vision"].update(self._vision_reads.summary())
            self._vision_reads = None
        self.m.weights.stop_prefetch()

    def vision_out(self) -> dict:
        """Merged visual tokens and DeepStack features: computed, or read from vision.out, once.

        Needed by prefill blocks of the first layers; after a reboot in prefill or decode it is
        only read if some such block has to be recomputed."""
        if self._vision_out is None:
            if self.inputs.image_grid_thw.shape[0] == 0:
                self._vision_out = {
                    "embeds": torch.zeros(0, self.a.text_config.hidden_size, device=self.device, dtype=self.m.dtype)
                }
            else:
                rec = self.store.read_vision_out() if self._frontier_at_open.vision_done else None
                if rec is not None:
                    self._vision_out = {k: v.to(self.device) for k, v in rec.tensors.items()}
                else:
                    self._vision_out = self._vision(self._frontier_at_open)
        return self._vision_out

    def _vision(self, fr: Frontier) -> dict:
        t0 = time.perf_counter()
        a, V = self.a, self.a.num_vision_blocks
        self.m.weights.ensure(*a.vision_prologue_modules())
        ctx = a.vision_context(self.inputs.image_grid_thw, self.device)
        start, side = 0, {}
        rec = None
        if fr.vision_block:
            reads = self._vision_reads
            rec = reads.result("vision.state") if reads is not None else self.store.read_vision_state(fr)
        if rec is not None:
            start = int(rec.meta["block"])
            h = rec.tensors["hidden"].to(self.device)
            side = {k: v.to(self.device) for k, v in rec.tensors.items() if k != "hidden"}
            self.events("vision_restored", block=start)
        else:
            h = a.vision_embed(ctx, self.inputs.pixel_values.to(self.device))
        last_state, deferred = start, 0  # the newest vision state handed to the writer; states dropped since
        for i in range(start, V):
            self.pacer.begin()
            unit_start = time.perf_counter()
            self.m.weights.ensure(*a.vision_block_modules(i))
            h, extra = a.vision_block(ctx, i, h)
            side.update(extra)
            self.pacer.end()
            self.e.cadence.observe_unit("vision", time.perf_counter() - unit_start)
            self.events("vision_block_done", block=i + 1, of=V)
            urgent = self.e.checkpoint_soon.is_set() and i + 1 < V and self.policy.writes_checkpoints()
            due = self.policy.vision_state_due(i + 1, V, self.g) or (
                i + 1 < V and self._early("vision", i + 1 - last_state, self.g.vision_every)
            )
            if urgent or due:
                self.e.checkpoint_soon.clear()
                # A cadence checkpoint is dropped while the previous record is still being
                # written (the next one supersedes it); one the bus asked for is not, and
                # neither is one after a dropped one: progress never waits on an idle writer
                # forever, and a window that can only write every other state still keeps one.
                kept = self._submit(
                    f"vision.state[{i + 1}]",
                    self.store.put_vision_state,
                    i + 1,
                    h,
                    dict(side),
                    optional=not urgent and deferred == 0,
                    phase="vision",
                )
                if kept:
                    last_state, deferred = i + 1, 0
                else:
                    deferred += 1
        self.m.weights.ensure(*a.vision_epilogue_modules())
        embeds = a.vision_finish(ctx, h)
        if self.policy.persist_vision_out() and self.checkpoints_enabled:
            # Written behind the prefill blocks that follow (it is large, and its tensors stay in
            # memory for the whole prefill anyway); the vision states go only once it is durable.
            self.writer.submit_background("vision.out", self._persist_vision_out, embeds, dict(side))
        self.times["vision"] += time.perf_counter() - t0
        self._note_held_peak("vision")
        return {"embeds": embeds, **side}

    def _persist_vision_out(self, embeds, side, between_slices=None) -> int:
        n = self.store.put_vision_out(embeds, side, between_slices=between_slices)
        self.store.remove_vision()
        return n

    # ---- prefill ----------------------------------------------------------------------------------
    def _prefill_and_decode(self, fr: Frontier):
        self.cache = DynamicCache(config=self.a.text_config)
        self.read_kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.kv_chunks = [0] * self.a.num_layers  # chunks present in the cache, per layer
        have_decode = bool(fr.decode_records)
        # From here on the plan's reader is the only weight stream (the vision reads overlapped
        # the vision phase): the plan orders weight reads with checkpoint reads on one channel.
        self._stop_vision_reads()
        self.m.weights.ensure(f"{self.a.lm_prefix}.rotary_emb")  # no weights; every block needs it
        visual_chunks = frozenset(c for c, (s, e) in enumerate(self.chunks) if bool(self.visual_mask[0, s:e].any()))
        for attempt in range(MAX_REPLANS):
            problem = RecoveryProblem(
                len(self.groups),
                len(self.chunks),
                set(fr.blocks),
                {b for b, i in fr.blocks.items() if i.has_hidden},
                need_last_hidden=not have_decode,
                kv_missing={b for b, i in fr.blocks.items() if i.kv_bytes == 0},
            )
            planner, overlap = self.policy.recovery(self.e.options.planner, self.e.options.overlap_recovery)
            operator_planner = (planner, overlap) == (self.e.options.planner, self.e.options.overlap_recovery)
            if not fr.blocks:  # nothing to restore: weights stream behind the compute, as in any fresh run
                overlap = self.e.options.overlap_recovery
            if operator_planner and have_decode and not problem.must_compute() and not problem.reprojections():
                # A decode restart: its first step needs the layer groups in order, each with its
                # weights and all its KV -- exactly layer-first's reads. (Baselines keep their own.)
                planner = "layer-first"
            elif planner == "optimal":
                problem.costs = self._plan_costs()
            plan = make_plan(planner, problem)
            self.scheduled = {(op.group, op.chunk) for op in plan.computes}
            total = len(self.groups) * len(self.chunks)
            self.prefill_done = total - sum(op.kind == "block" for op in plan.computes)  # for progress reports
            if (
                self._vision_out is None
                and fr.vision_done
                and any(op.kind == "block" and op.group == 0 and op.chunk in visual_chunks for op in plan.computes)
            ):
                plan.reads.insert(0, VISION_OUT)  # read once, first, not inside the block that needs it
            self.plan_summary = plan.summary()
            self.plan_summary["vision_out_read"] = VISION_OUT in plan.reads
            self.decode_restart = None
            if have_decode:
                self.decode_restart = self._decode_restart(fr)
                plan.computes = plan.computes + [StepOp(g) for g in range(len(self.groups))]
                self.phase_plans["decode"] = {
                    "step": self.decode_restart["step"],
                    "planner": planner,
                    "reads": len(plan.reads),
                    "groups": len(self.groups),
                }
            if fr.blocks:
                self.events("recovery_plan", **self.plan_summary)
            t0 = time.perf_counter()
            self.fr = fr
            executor = PhaseExecutor(
                plan,
                self._read_op,
                self._compute_op,
                overlap=overlap,
                visual_chunks=visual_chunks,
                num_chunks=len(self.chunks),
            )
            try:
                stats = executor.run()
            except RecordRejected as exc:
                info = fr.blocks.get((exc.op.group, exc.op.chunk))
                if info is not None:
                    self.store.quarantine(info.path, exc.error.reason)
                fr = self.store.scan()
                have_decode = bool(fr.decode_records)
                self.cache = DynamicCache(config=self.a.text_config)
                self.read_kv.clear()
                self.hidden.clear()
                self.kv_chunks = [0] * self.a.num_layers
                continue
            self.times["prefill"] += time.perf_counter() - t0
            if have_decode:
                self.phase_plans["decode"].update(
                    read_s=round(stats.read_seconds, 6),
                    stall_s=round(stats.stall_seconds, 6),
                    wall_s=round(stats.wall_seconds, 6),
                    bytes_read=stats.bytes_read,
                )
            self._note_held_peak("prefill")
            self.plan_summary.update(
                read_s=round(stats.read_seconds, 6),
                compute_s=round(stats.compute_seconds, 6),
                stall_s=round(stats.stall_seconds, 6),
                wall_s=round(stats.wall_seconds, 6),
                bytes_read=stats.bytes_read,
            )
            if fr.blocks:
                self.events(
                    "prefill_restored",
                    stall_s=round(stats.stall_seconds, 4),
                    read_s=round(stats.read_seconds, 4),
                    bytes_read=stats.bytes_read,
                )
            break
        else:
            raise RuntimeError("recovery could not find a consistent set of records")
        for layer in range(self.a.num_layers):
            self._extend_kv(layer, len(self.chunks))
        self.read_kv.clear()
        return self._decode(fr)

    def _plan_costs(self) -> dict:
        """Costs for the optimal planner: this machine's calibration, with reads at the storage's
        real (possibly throttled, target-emulating) bandwidth."""
        from dataclasses import replace

        from .recovery.cost import cost_model_for

        model = cost_model_for(self.m)
        bucket = getattr(self.store.fs, "read_bucket", None)
        if bucket is not None:
            model = replace(model, read_bytes_per_s=bucket.rate)
        return model.problem_costs(self.groups, self.chunks)

    def _read_op(self, op: ReadOp) -> int:
        a = self.a
        if op.what == VISION_OUT.what:
            rec = self.store.read_vision_out()
            if rec is None:
                return 0  # damaged (quarantined): the block that needs it recomputes the vision phase
            self._vision_out = {k: v.to(self.device) for k, v in rec.tensors.items()}
            return _tensor_bytes(rec)
        if op.what == "weights":
            l0, l1 = self.groups[op.group]
            mods = (a.embed_modules() if op.group == 0 else []) + [m for l in range(l0, l1) for m in a.layer_modules(l)]
            if op.group == len(self.groups) - 1:
                mods += a.head_modules()
            before = self.m.weights.stats.bytes_read
            self.m.weights.ensure(*mods)
            return self.m.weights.stats.bytes_read - before
        info = self.fr.blocks[(op.group, op.chunk)]
        tensors = self.store.read_block(info, {op.what})
        if op.what == "kv":
            for layer in range(*info.layers):
                self.read_kv[(layer, op.chunk)] = (
                    tensors[f"k.{layer}"].to(self.device),
                    tensors[f"v.{layer}"].to(self.device),
                )
            return info.kv_bytes
        self.hidden[(op.group, op.chunk)] = tensors["hidden"].to(self.device)
        return info.hidden_bytes

    def _extend_kv(self, layer: int, upto: int) -> None:
        """Append read KV chunks [present, upto) of `layer` to the cache (bitwise what compute made)."""
        have = self.kv_chunks[layer]
        if have >= upto:
            return
        ks, vs = zip(*(self.read_kv.pop((layer, c)) for c in range(have, upto)))
        cache_layer = self.cache.layers[layer]
        if not cache_layer.is_initialized:
            cache_layer.lazy_initialization(ks[0], vs[0])
        cache_layer.keys = torch.cat([cache_layer.keys, *ks], dim=-2)
        cache_layer.values = torch.cat([cache_layer.values, *vs], dim=-2)
        self.kv_chunks[layer] = upto

    def _embed_chunk(self, c: int) -> torch.Tensor:
        s, e = self.chunks[c]
        self.m.weights.ensure(*self.a.embed_modules())
        x = self.a.embed(self.inputs.input_ids[:, s:e].to(self.device))
        vis = self.visual_mask[:, s:e]
        if bool(vis.any()):
            rows = self.visual_rows[s:e][vis[0]]
            embeds = self.vision_out()["embeds"][rows].to(x.dtype)
            x = x.masked_scatter(vis[..., None].expand_as(x), embeds)
        return x

    def _reproject_op(self, op: ComputeOp) -> None:
        """Rebuild a block's KV from its input hidden state (records that hold no KV)."""
        g, c = op.group, op.chunk
        (l0, l1), (s, e) = self.groups[g], self.chunks[c]
        if l1 - l0 != 1:
            raise RuntimeError("KV re-projection needs one layer per block (G = 1)")
        self.pacer.begin()
        self.m.weights.ensure(*self.a.layer_modules(l0))
        h = self._embed_chunk(c) if g == 0 else self.hidden.pop((g - 1, c))
        pe = self.a.rotary(h, self.pos4[1:, :, s:e])
        self.read_kv[(l0, c)] = self.a.reproject_kv(l0, h, self.pos4[0, :, s:e], pe)
        self.pacer.end(units=REPROJECT_SHARE)

    def _compute_op(self, op: ComputeOp) -> None:
        if op.kind == "decode":
            return self._first_step_group(op)
        if op.kind == "reproject":
            return self._reproject_op(op)
        self.pacer.begin()
        g, c = op.group, op.chunk
        (l0, l1), (s, e) = self.groups[g], self.chunks[c]
        a = self.a
        self.m.weights.ensure(*[m for l in range(l0, l1) for m in a.layer_modules(l)])
        for layer in range(l0, l1):
            self._extend_kv(layer, c)
        h = self._embed_chunk(c) if g == 0 else self.hidden.pop((g - 1, c))
        text_pos = self.pos4[0, :, s:e]
        attention_mask = torch.ones(1, e, dtype=torch.long, device=self.device)
        mask = a.mask(h, attention_mask, self.cache, text_pos, layer_idx=l0)
        pe = a.rotary(h, self.pos4[1:, :, s:e])
        vis = self.visual_mask[:, s:e]
        rows = self.visual_rows[s:e][vis[0]]
        layer_inputs = {}
        for layer in range(l0, l1):
            if self.policy.layer_input_hidden():
                layer_inputs[layer] = h
            h = a.layer(layer, h, mask, text_pos, self.cache, pe)
            if layer < a.deepstack_layers:
                ds = self.vision_out()[f"deepstack.{layer}"][rows] if bool(vis.any()) else None
                h = a.after_layer(layer, h, vis, ds)
        self.kv_chunks[l0:l1] = [c + 1] * (l1 - l0)
        if (g + 1, c) in self.scheduled or (g, c) == (len(self.groups) - 1, len(self.chunks) - 1):
            self.hidden[(g, c)] = h
        self.pacer.end(units=l1 - l0)
        self.prefill_done += 1
        self.events(
            "prefill_block_done", group=g, chunk=c, done=self.prefill_done, of=len(self.groups) * len(self.chunks)
        )
        persist = self.policy.prefill_block(g, c, len(self.groups), len(self.chunks))
        if persist is not None:

            def copy_block():  # called once the writer has room for one more record
                kv = (
                    {
                        layer: (
                            self.cache.layers[layer].keys[:, :, s:e].clone(memory_format=torch.contiguous_format),
                            self.cache.layers[layer].values[:, :, s:e].clone(memory_format=torch.contiguous_format),
                        )
                        for layer in range(l0, l1)
                    }
                    if persist.kv
                    else {}
                )
                return g, c, (l0, l1), (s, e), kv, h if persist.boundary_hidden else None

            self._submit(f"prefill[g{g},c{c}]", self.store.put_prefill_block, make_args=copy_block)
        for layer, h_in in layer_inputs.items():
            self._submit(f"hidden[l{layer},c{c}]", self.store.put_layer_hidden, layer, c, (s, e), h_in)

    # ---- decode -------------------------------------------------------------------------------------
    def _decode(self, fr: Frontier):
        t0 = time.perf_counter()
        a, N, S = self.a, self.max_new_tokens, self.S
        eos = set(self.m.eos_token_ids)
        self.m.weights.ensure(*a.head_modules())
        logits = pending = None
        if fr.decode_records:
            # The restart's first step already ran, layer group by layer group, behind the reads
            # (_first_step_group); its KV and the decode records' are in the cache.
            restart = self.decode_restart
            tokens, step = list(restart["tokens"]), restart["step"]
            self.decode_durable_step = step
            self.store.prepare_decode_log(fr.decode_log_end)
            self.events("decode_restored", step=step)
            if restart["finished"]:
                # Finished, but the final logits never reached RESULT: the step redid the last one.
                tokens.pop()
                logits = restart["logits"]
                tokens.append(int(logits.argmax(-1)))
            else:
                pending = restart
        else:
            self.store.prepare_decode_log(0)
            self.decode_durable_step = 0
            logits = a.logits(self.hidden.pop((len(self.groups) - 1, len(self.chunks) - 1)))
            tokens, step = [int(logits.argmax(-1))], 0
        self.hidden.clear()
        self.tokens = tokens
        submitted = step
        while len(tokens) < N and tokens[-1] not in eos:
            if pending is not None:  # computed (and paced) during the restart's reads
                logits, unit_start, pending = pending["logits"], pending["started"], None
            else:
                self.pacer.begin()
                unit_start = time.perf_counter()
                logits = self._decode_step(tokens[-1], S + step)
                self.pacer.end()
            tokens.append(int(logits.argmax(-1)))
            step += 1
            self.e.cadence.observe_unit("decode", time.perf_counter() - unit_start)
            self.events("decode_step_done", step=step, of=N - 1)
            finished = len(tokens) >= N or tokens[-1] in eos
            if finished:
                continue  # the final step is covered by RESULT, which also holds its logits
            urgent = self.e.checkpoint_soon.is_set() and self.policy.writes_checkpoints()
            if urgent or self.policy.decode_record_due(step - submitted, self.g, finished):
                self.e.checkpoint_soon.clear()
                self._submit(f"decode[..{step}]", self._write_decode_record, step, phase="decode")
                submitted = step
            elif self._early("decode", step - submitted, self.g.decode_every):
                # Optional: a record covers every step since the last durable one, so one the
                # busy writer drops is covered by the next.
                if self._submit(f"decode[..{step}]", self._write_decode_record, step, optional=True, phase="decode"):
                    submitted = step
        self.times["decode"] += time.perf_counter() - t0
        self._note_held_peak("decode")
        finish = "eos" if tokens[-1] in eos else "length"
        return tokens, logits, finish

    def _decode_restart(self, fr: Frontier) -> dict:
        """Where a restart in decode stands: the tokens of the decode records, the durable step,
        and whether the request had already produced all its tokens (then the first step redoes
        the last one, whose logits never reached RESULT)."""
        tokens = [int(fr.decode_records[0].meta["first_token"])]
        for rec in fr.decode_records:
            tokens += rec.tensors["tokens"].tolist()
        finished = len(tokens) >= self.max_new_tokens or tokens[-1] in set(self.m.eos_token_ids)
        return {"tokens": tokens, "step": len(tokens) - 1, "finished": finished, "logits": None}

    def _first_step_group(self, op: StepOp) -> None:
        """The restart's first decode step through layer group `op.group`, once that group's
        weights and KV are in (PhaseExecutor orders it): its prefill KV and the decode records'
        KV join the cache, then its layers run."""
        a, r = self.a, self.decode_restart
        (l0, l1) = self.groups[op.group]
        for layer in range(l0, l1):
            self._extend_kv(layer, len(self.chunks))
            cl = self.cache.layers[layer]
            for rec in self.fr.decode_records:
                k, v = (_dequantize(rec.tensors, f"{kind}.{layer}", cl.keys.dtype) for kind in ("k", "v"))
                cl.keys = torch.cat([cl.keys, k.to(self.device)], dim=-2)
                cl.values = torch.cat([cl.values, v.to(self.device)], dim=-2)
            if r["finished"]:
                cl.keys, cl.values = cl.keys[:, :, :-1], cl.values[:, :, :-1]
        if op.group == 0:
            self.pacer.begin()
            r["started"] = time.perf_counter()
            step = r["step"] - 1 if r["finished"] else r["step"]
            token = r["tokens"][step]
            position = self.S + step
            h = a.embed(torch.tensor([[token]], device=self.device))
            r["text_pos"] = torch.tensor([[position]], device=self.device)
            mrope = (r["text_pos"] + self.rope_deltas.to(self.device))[None].expand(3, 1, 1)
            # The mask looks at layer 0's cache only, which is complete now (as in _decode_step).
            r["mask"] = a.mask(
                h, torch.ones(1, position + 1, dtype=torch.long, device=self.device), self.cache, r["text_pos"]
            )
            r["pe"] = a.rotary(h, mrope)
        else:
            h = r.pop("h")
        for layer in range(l0, l1):
            self.m.weights.ensure(*a.layer_modules(layer))
            h = a.layer(layer, h, r["mask"], r["text_pos"], self.cache, r["pe"])
        if op.group == len(self.groups) - 1:
            self.m.weights.ensure(*a.head_modules())
            r["logits"] = a.logits(h)
            self.pacer.end()
        else:
            r["h"] = h

    def _decode_step(self, token: int, position: int) -> torch.Tensor:
        a = self.a
        h = a.embed(torch.tensor([[token]], device=self.device))
        text_pos = torch.tensor([[position]], device=self.device)
        mrope = (text_pos + self.rope_deltas.to(self.device))[None].expand(3, 1, 1)
        mask = a.mask(h, torch.ones(1, position + 1, dtype=torch.long, device=self.device), self.cache, text_pos)
        pe = a.rotary(h, mrope)
        for layer in range(a.num_layers):
            self.m.weights.ensure(*a.layer_modules(layer))
            h = a.layer(layer, h, mask, text_pos, self.cache, pe)
        return a.logits(h)

    def _write_decode_record(self, step_end: int) -> int:
        """Runs on the writer: one record covering every step since the last record that reached
        the disk (so a record skipped for a full disk leaves no gap). Slices are taken now from
        the cache, whose tensors are replaced, never modified, as decoding goes on."""
        step_start, S = self.decode_durable_step, self.S
        s, e = S + step_start, S + step_end
        kv = {}
        for layer in range(self.a.num_layers):
            cl = self.cache.layers[layer]
            kv[layer] = (
                cl.keys[:, :, s:e].clone(memory_format=torch.contiguous_format),
                cl.values[:, :, s:e].clone(memory_format=torch.contiguous_format),
            )
        meta = {
            "step_start": step_start,
            "step_end": step_end,
            "pos_start": s,
            "pos_end": e,
            "first_token": self.tokens[0],
        }
        new_tokens = torch.tensor(self.tokens[step_start + 1 : step_end + 1], dtype=torch.int64)
        if self.e.options.decode_kv_compression == "int8":
            kv = {layer: (_quantize(k), _quantize(v)) for layer, (k, v) in kv.items()}
        n = self.store.append_decode(meta, kv, new_tokens)
        self.decode_durable_step = step_end
        return n


def _tensor_bytes(rec) -> int:
    return sum(t.numel() * t.element_size() for t in rec.tensors.values()) if rec is not None else 0


def _quantize(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric int8 with one float32 scale per token and head (over the head dimension), so
    the scales stay a small fraction (1/head_dim) of the values however few steps a record holds."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return {"q": torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), "scale": scale}


def _dequantize(tensors: dict, name: str, dtype: torch.dtype) -> torch.Tensor:
    if f"{name}.scale" not in tensors:
        return tensors[name]
    return (tensors[name].float() * tensors[f"{name}.scale"]).to(dtype)
