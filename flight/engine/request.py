"""The engine's front: `Engine` (the boundary), `Result`, `RunOutcome`, and one request's run from
open to RESULT.

A caller that may have to end a run early hands `Engine.run_or_stop` a `StopToken`
(flight/events.py): the run ends at the next unit boundary and returns a `RunOutcome` whose
status says how it ended (FINISHED with its `Result`, PAUSED, CANCELLED, or AWAITING_INPUTS when
the inputs could not give the pixel patches a unit needed); nothing is raised through the
engine for it. `Engine.run` is the run to the end.

`Engine` is where names become objects: the policy named in `EngineOptions` (unless the caller
hands one) and the cost model the optimal planner uses (unless the caller hands one: by default
this machine's cached calibration, else the model's byte counts at the target device's rates;
flight/recovery/calibration_cache.py). Everything below it is handed what it uses.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import transformers

from common.durable import DurableFS, is_storage_fault
from flight.checkpoint.cadence import Cadence
from flight.checkpoint.policies import Geometry, Policy, get_policy
from flight.checkpoint.store import CheckpointStore, Frontier, OpenOutcome
from flight.checkpoint.writer import CheckpointWriter
from flight.events import EngineEvent, Events, RunStatus, StopToken, no_events
from flight.model.inputs import RequestInputs
from flight.model.loader import LoadedModel
from flight.options import EngineOptions, resolve_cadence
from flight.recovery.calibration_cache import cost_model_for
from flight.recovery.cost import CostModel

from .context import LanguageState, RequestContext, RequestSpec
from .decode import DecodePhase
from .prefill import PrefillBlocks
from .records import RecordSink
from .restore import PrefillRestore, restart_planner
from .vision import VisionPhase


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
    # One entry per restart of the request, over all its boots, from its durable recovery log
    # (docs/record-format.md, RECOVERY): `restart`, `phase`, `position`, `restore_s`, `planner`,
    # `written` (lifetime bytes before that boot).
    recoveries: list = field(default_factory=list)
    # Bytes of checkpoint records the request wrote over its whole life, every boot included
    # (`bytes_written` is this boot's); None where the records could not say (no MANIFEST).
    lifetime_bytes_written: int | None = None

    def logits_sha256(self) -> str:
        return hashlib.sha256(self.logits.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class RunOutcome:
    """How one run of a request ended: FINISHED with its `result`; PAUSED or CANCELLED at a unit
    boundary (`stopped_after`: that unit's UNIT_DONE event and fields), its records as the
    boundary before left them (a later run resumes from them); AWAITING_INPUTS before a unit
    whose inputs could not be had (`stopped_after` None)."""

    status: RunStatus
    result: Result | None = None
    stopped_after: dict[str, Any] | None = None


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        options: EngineOptions | None = None,
        fs: DurableFS | None = None,
        events: Events | None = None,
        after_commit: Callable[[str, int], None] | None = None,
        cadence: Cadence | None = None,
        *,
        policy: Policy | None = None,
        cost_model: CostModel | None = None,
    ):
        self.model = model
        self.options = options or EngineOptions()
        # The boundary: a policy named in the options is resolved here, once.
        self.policy = policy if policy is not None else get_policy(self.options.policy)
        self.geometry = self.policy.geometry(self.options.geometry, model.adapter.num_layers)
        self.cost_model = cost_model  # None: the calibration cache's, looked up when a plan needs it
        # What the payload knows about its windows (warnings, telemetry, history); the caller's
        # when it has one (the onboard process), else one that knows only this engine's timings.
        # An options object that names no cadence gets the default of the policy that runs.
        self.cadence = cadence or Cadence(resolve_cadence(self.policy.name, self.options.cadence))
        self.adaptive = self.cadence.mode == "adaptive" and self.policy.adaptive_cadence
        self.fs = fs
        self.events: Events = events or no_events
        self.after_commit = after_commit
        # Set from any thread (e.g. on a bus shutdown warning): persist progress at the next unit
        # boundary instead of waiting for the policy's cadence.
        self.checkpoint_soon = threading.Event()
        if self.options.threads:
            torch.set_num_threads(self.options.threads)

    def task_geometry(self, store: CheckpointStore, inputs: RequestInputs) -> Geometry:
        """The geometry one task runs with: the engine's, except that the adaptive cadence picks
        the prefill block's layers (G) when the task has no MANIFEST yet, from the windows the
        payload has lived through (Cadence.prefill_group), and a resume reads its G back from
        the MANIFEST, so every record of a task has one block shape."""
        if not self.adaptive:
            return self.geometry
        num_layers = self.model.adapter.num_layers
        stored = store.stored_manifest()
        group = stored.get("group") if stored is not None else None
        if isinstance(group, int) and not isinstance(group, bool) and 1 <= group <= self.geometry.group:
            return replace(self.geometry, group=group)
        if not self.cadence.shapes_blocks(self.geometry.group):
            return self.geometry  # too little history (or G = 1): no cost estimate to look up
        # One decoder layer on one chunk: the pace where the payload is paced (the testbench's
        # stand-in for the target's compute), else the calibrated cost model's estimate.
        chunk_tokens = min(self.geometry.chunk, inputs.num_tokens)
        try:
            estimate = self.planning_costs().compute_s(1, chunk_tokens, 0)
        except (OSError, ValueError, KeyError) as exc:  # the shape is advice: never a reason to fail the task
            self.events(EngineEvent.BLOCK_SHAPE_ESTIMATE_FAILED, reason=f"{type(exc).__name__}: {exc}")
            estimate = 0.0
        layer_chunk_s = max(self.options.pace_ms / 1000.0, estimate)
        group = self.cadence.prefill_group(self.geometry.group, layer_chunk_s)
        return replace(self.geometry, group=min(group, num_layers))

    def manifest(self, inputs: RequestInputs, max_new_tokens: int, geometry: Geometry | None = None) -> dict:
        model, geometry = self.model, geometry or self.geometry
        return {
            "model_hash": model.content_hash,
            "arch": model.model_type,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": str(model.dtype).removeprefix("torch."),
            "attn_implementation": model.attn_implementation,
            "threads": torch.get_num_threads(),
            "device_type": model.device.type,
            "chunk": geometry.chunk,
            "group": geometry.group,
            "decode_every": geometry.decode_every,
            "vision_every": geometry.vision_every,
            "policy": self.policy.name,
            "inputs_hash": inputs.digest(),
            "max_new_tokens": int(max_new_tokens),
            "decode_kv_compression": self.options.decode_kv_compression,
        }

    def planning_costs(self) -> CostModel:
        """The cost model the optimal planner plans with (the one handed in, else the default)."""
        return self.cost_model if self.cost_model is not None else cost_model_for(self.model)

    def run(self, inputs: RequestInputs, ckpt_dir: str, max_new_tokens: int) -> Result:
        """Run the request to its end (nothing can stop it but a cut): its Result."""
        outcome = self.run_or_stop(inputs, ckpt_dir, max_new_tokens, stop=None)
        if outcome.result is None:  # no stop token: only inputs that could not be had end it early
            raise RuntimeError(f"the request's run ended {outcome.status}: its inputs could not be had")
        return outcome.result

    def run_or_stop(
        self, inputs: RequestInputs, ckpt_dir: str, max_new_tokens: int, stop: StopToken | None
    ) -> RunOutcome:
        """Run the request until it finishes or `stop` asks it to end, which it does at the next
        unit boundary (flight/events.py, "How a run ends")."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        run = RequestRun(self, inputs, ckpt_dir, max_new_tokens, stop)
        with torch.inference_mode():
            return run.execute()


class RequestRun:
    """One request inside one process lifetime: open its directory, find the frontier, run the
    phases from there, commit RESULT."""

    def __init__(
        self, engine: Engine, inputs: RequestInputs, ckpt_dir: str, max_new_tokens: int, stop: StopToken | None = None
    ):
        self.engine = engine
        self.stop = stop
        self.inputs = inputs
        self.max_new_tokens = max_new_tokens
        self.events = engine.events
        self.store = CheckpointStore(ckpt_dir, engine.fs, events=self.events)
        self.geometry = engine.task_geometry(self.store, inputs)
        self.phase_seconds = {"restore": 0.0, "vision": 0.0, "prefill": 0.0, "decode": 0.0}
        self.phase_plans: dict[str, dict] = {}
        self.recoveries: list[dict] = []  # every restart's entry, this one's last
        self.num_groups = len(self.geometry.layer_groups(engine.model.adapter.num_layers))
        self.num_chunks = len(self.geometry.token_chunks(inputs.num_tokens))
        # False when the policy writes none or not even the MANIFEST fits on the disk.
        self.checkpoints_enabled = engine.policy.writes_checkpoints()

    def execute(self) -> RunOutcome:
        engine = self.engine
        manifest = engine.manifest(self.inputs, self.max_new_tokens, self.geometry)
        try:
            outcome = self.store.open(manifest)
        except OSError as exc:
            if not is_storage_fault(exc):
                raise
            # Not even the MANIFEST fits: run without checkpoints rather than not at all.
            self.events(
                EngineEvent.CHECKPOINT_WRITE_FAILED, record="MANIFEST", errno=exc.errno, reason=str(exc.strerror)
            )
            self.checkpoints_enabled = False
            outcome = OpenOutcome(0, "no_space", {})
        restarted = None
        if outcome.status in ("mismatch", "unreadable_manifest"):
            restarted = outcome.status
            self.events(
                EngineEvent.MANIFEST_MISMATCH,
                status=outcome.status,
                differences={name: [str(old), str(new)] for name, (old, new) in outcome.differences.items()}
                if outcome.status == "mismatch"
                else outcome.differences,
            )
        scan_started = time.perf_counter()
        frontier = self.store.scan() if self.checkpoints_enabled or outcome.status == "resume" else Frontier()
        restore_s = time.perf_counter() - scan_started
        self.phase_seconds["restore"] += restore_s
        phase = frontier.phase()
        resumed_from = self._describe(frontier, phase)
        if outcome.status == "resume":  # a restart, also one that finds the RESULT (phase "done")
            self.recoveries = self._record_restart(frontier, resumed_from, restore_s)
        self.events(
            EngineEvent.REQUEST_OPENED,
            status=outcome.status,
            **resumed_from,
            prompt_tokens=self.inputs.num_tokens,
            chunks=self.num_chunks,
            groups=self.num_groups,
        )
        if frontier.result is not None:
            return RunOutcome(RunStatus.FINISHED, self._result_from_record(frontier.result, resumed_from))
        # A policy that commits on the compute path (an intermittent-computing task runtime)
        # gets a synchronous writer: each record is durable before the next unit of work.
        asynchronous = engine.options.async_writes and not engine.policy.synchronous_commits()
        writer = CheckpointWriter(self.events, asynchronous, engine.after_commit)
        records = RecordSink(
            self.store,
            writer,
            self.events,
            engine.cadence,
            enabled=self.checkpoints_enabled,
            adaptive=engine.adaptive,
        )
        try:
            ran = self._run_phases(frontier, records)
            if isinstance(ran, RunOutcome):
                # Stopped at a unit boundary: what was handed to the writer before it is
                # written (close, below); nothing of the unit it stopped after, no RESULT.
                return ran
            tokens, logits, finish, plan_summary = ran
            writer.drain()
            text = engine.model.decode(tokens)
            records.commit_result(tokens, logits, text, finish)
        finally:
            writer.close()
        return RunOutcome(
            RunStatus.FINISHED,
            Result(
                tokens,
                text,
                logits,
                finish,
                resumed=phase != "start",
                resumed_from=resumed_from,
                bytes_written=self.store.bytes_written,
                phase_seconds={name: round(seconds, 6) for name, seconds in self.phase_seconds.items()},
                records_written=writer.records_committed,
                records_skipped=writer.records_skipped,
                records_deferred=writer.records_deferred,
                held_state_peak_bytes=records.held_peaks,
                write_seconds=writer.busy_seconds,
                restarted_reason=restarted,
                plan=plan_summary,
                phase_plans=self.phase_plans,
                recoveries=self.recoveries,
                lifetime_bytes_written=self.store.lifetime_written if self.store.salt else None,
            ),
        )

    def _run_phases(
        self, frontier: Frontier, records: RecordSink
    ) -> tuple[list[int], torch.Tensor, str, dict | None] | RunOutcome:
        """Vision (when it is the next work), prefill as a recovery plan, decode; the outcome
        instead when the stop token ended the run at a unit boundary."""
        engine = self.engine
        spec = RequestSpec(
            engine.model,
            engine.options,
            engine.policy,
            self.geometry,
            engine.planning_costs,
            self.inputs,
            self.max_new_tokens,
        )
        request = RequestContext(
            spec,
            store=self.store,
            records=records,
            events=self.events,
            cadence=engine.cadence,
            checkpoint_soon=engine.checkpoint_soon,
            phase_seconds=self.phase_seconds,
            phase_plans=self.phase_plans,
            stop=self.stop,
        )
        vision = VisionPhase(request, frontier)
        vision_next = not frontier.vision_done and not frontier.blocks and not frontier.decode_records
        # Reads stream in the order this request needs them, behind the compute.
        if vision_next and self.inputs.image_grid_thw.shape[0] > 0:
            vision.start_reads()
        try:
            if vision_next and vision.out() is None:  # the vision phase is the next work: run it now
                return self._stopped(request)
            state = LanguageState(request.adapter)
            # From here on the plan's reader is the only weight stream (the vision reads overlapped
            # the vision phase): the plan orders weight reads with checkpoint reads on one channel.
            vision.stop_reads()
            engine.model.weights.ensure(f"{request.adapter.lm_prefix}.rotary_emb")  # no weights; every block needs it
            blocks = PrefillBlocks(request, state, vision)
            decode = DecodePhase(request, state)
            restore = PrefillRestore(request, state, vision, blocks, decode)
            restored = restore.run(frontier)
            if restored is None:
                return self._stopped(request)
            frontier = restored
            for layer in range(request.adapter.num_layers):
                state.extend_kv(layer, len(request.token_chunks))
            state.read_kv.clear()
            decoded = decode.run(frontier)
            if decoded is None:
                return self._stopped(request)
            tokens, logits, finish = decoded
            return tokens, logits, finish, restore.plan_summary
        finally:
            vision.stop_reads()

    @staticmethod
    def _stopped(request: RequestContext) -> RunOutcome:
        assert request.stopped is not None, "a phase returned early without a stop"
        return RunOutcome(request.stopped, stopped_after=request.stopped_after)

    def _record_restart(self, frontier: Frontier, resumed_from: dict, restore_s: float) -> list[dict]:
        """Append this restart to the request's recovery log, durably, before any work of this
        boot: a cut from here on leaves it recorded once. Every entry so far, this one last.
        A disk that refuses the entry costs the entry (an event says so), never the request."""
        entry = {
            "restart": len(self.store.recoveries()[0]) + 1,
            "phase": resumed_from["phase"],
            "position": resumed_from["position"],
            "restore_s": round(restore_s, 6),
            "planner": restart_planner(
                self.engine.policy, self.engine.options, frontier, self.num_groups * self.num_chunks
            ),
            "written": self.store.lifetime_written,
        }
        try:
            return self.store.append_recovery(entry)
        except OSError as exc:
            if not is_storage_fault(exc):
                raise
            self.events(
                EngineEvent.CHECKPOINT_WRITE_FAILED, record="RECOVERY", errno=exc.errno, reason=str(exc.strerror)
            )
            return [*self.store.recoveries()[0], entry]

    def _describe(self, frontier: Frontier, phase: str) -> dict:
        if phase == "done":
            return {"phase": "done", "position": None}
        if phase == "decode":
            return {"phase": "decode", "position": frontier.decode_steps}
        if phase == "prefill":
            return {
                "phase": "prefill",
                "position": len(frontier.blocks),
                "blocks_total": self.num_groups * self.num_chunks,
            }
        if phase == "vision":
            return {"phase": "vision", "position": frontier.vision_block}
        return {"phase": "start", "position": 0}

    def _result_from_record(self, record, resumed_from: dict) -> Result:
        return Result(
            record.tensors["token_ids"].tolist(),
            record.meta["text"],
            record.tensors["logits"].clone(),
            record.meta["finish_reason"],
            resumed=True,
            resumed_from=resumed_from,
            bytes_written=0,
            phase_seconds={name: 0.0 for name in self.phase_seconds},
            recoveries=self.recoveries,
            lifetime_bytes_written=self.store.lifetime_written,
        )
