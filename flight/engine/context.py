"""What every phase of one request shares, and the language model's state between blocks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from transformers.cache_utils import DynamicCache

from flight.checkpoint.cadence import Cadence
from flight.checkpoint.policies import Geometry, Policy
from flight.checkpoint.store import CheckpointStore
from flight.events import EngineEvent, Events, RunStatus, StopToken
from flight.model.adapters import Adapter
from flight.model.inputs import RequestInputs
from flight.model.loader import LoadedModel
from flight.options import EngineOptions
from flight.recovery.cost import CostModel

from .pacing import Pacer
from .records import RecordSink


class RopePositions:
    """The request's rotary positions and where its visual tokens sit."""

    def __init__(self, model: LoadedModel, inputs: RequestInputs):
        adapter, device = model.adapter, model.device
        position_ids, self.rope_deltas = adapter.rope_index(
            inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw
        )
        # (4, 1, S): row 0 the text positions, rows 1-3 the multimodal rotary (t, h, w) positions.
        self.position_ids = position_ids.to(device)
        self.visual_mask = (inputs.input_ids == adapter.image_token_id).to(device)  # (1, S)
        # For each prompt position, the row of the merged visual tokens it takes (at visual positions).
        self.visual_rows = self.visual_mask[0].cumsum(0) - 1

    def text(self, start: int, end: int) -> torch.Tensor:
        return self.position_ids[0, :, start:end]

    def mrope(self, start: int, end: int) -> torch.Tensor:
        return self.position_ids[1:, :, start:end]


@dataclass(frozen=True)
class RequestSpec:
    """What one request is, fixed for its whole run: the model, the options, policy and
    geometry the engine runs it with, the cost model its plans use, its inputs and its token
    budget. Nothing here changes while the request runs (what does is in RequestContext)."""

    model: LoadedModel
    options: EngineOptions
    policy: Policy
    geometry: Geometry
    cost_model: Callable[[], CostModel]  # called when the optimal planner needs costs
    inputs: RequestInputs
    max_new_tokens: int


class RequestContext:
    """One request inside one process lifetime: its fixed inputs (`spec`), the block grid, and
    where records, events and time go."""

    def __init__(
        self,
        spec: RequestSpec,
        *,
        store: CheckpointStore,
        records: RecordSink,
        events: Events,
        cadence: Cadence,
        checkpoint_soon: threading.Event,
        phase_seconds: dict[str, float],
        phase_plans: dict[str, dict],
        stop: StopToken | None = None,
    ):
        self.spec = spec
        model, inputs, geometry = spec.model, spec.inputs, spec.geometry
        self.model = model
        self.adapter = model.adapter
        self.device = model.device
        self.options = spec.options
        self.policy = spec.policy
        self.geometry = geometry
        self.cost_model = spec.cost_model
        self.inputs = inputs
        self.max_new_tokens = spec.max_new_tokens
        self.prompt_tokens = inputs.num_tokens
        self.layer_groups = geometry.layer_groups(self.adapter.num_layers)
        self.token_chunks = geometry.token_chunks(self.prompt_tokens)
        self.store = store
        self.records = records
        self.events = events
        self.cadence = cadence
        self.checkpoint_soon = checkpoint_soon  # set from any thread: persist at the next unit boundary
        self.pacer = Pacer(spec.options.pace_ms)
        self.phase_seconds = phase_seconds
        self.phase_plans = phase_plans
        self.positions = RopePositions(model, inputs)
        self.stop = stop  # looked at once per unit boundary (`unit_done`)
        # How the run ends early, once decided at a unit boundary, and the unit it ended after:
        # every phase returns at once when this is set (nothing after that boundary runs).
        self.stopped: RunStatus | None = None
        self.stopped_after: dict[str, Any] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.layer_groups) * len(self.token_chunks)

    def unit_done(self, event: EngineEvent, **fields: Any) -> bool:
        """A unit of work ended (`event` one of flight.events.UNIT_DONE): report it, then look at
        the stop token. True when the run ends at this boundary -- before what the policy keeps
        of this unit goes to the writer, so the records stay as the previous boundary left them."""
        self.events(event, **fields)
        if self.stopped is None and self.stop is not None:
            self.stopped = self.stop.requested()
            if self.stopped is not None:
                self.stopped_after = {"event": event, **fields}
        return self.stopped is not None

    def await_inputs(self) -> None:
        """The inputs cannot give what the next unit needs (`RequestInputs.pixels()` is None):
        the run ends here, before that unit, with AWAITING_INPUTS (every phase returns at once)."""
        if self.stopped is None:
            self.stopped = RunStatus.AWAITING_INPUTS

    def checkpoint_requested(self) -> bool:
        """The bus asked for a checkpoint soon (a shutdown warning) and this policy writes some."""
        return self.checkpoint_soon.is_set() and self.policy.writes_checkpoints()

    def load_weights(self, *modules: str) -> int:
        """Make `modules` resident; the bytes this read from storage."""
        weights = self.model.weights
        before = weights.stats.bytes_read
        weights.ensure(*modules)
        return weights.stats.bytes_read - before


class KVLayer(Protocol):
    """One full-attention layer of the KV cache (transformers' DynamicLayer), as the engine uses it."""

    keys: torch.Tensor
    values: torch.Tensor
    is_initialized: bool

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...


class LanguageState:
    """The language model's state while prefill and decode run: the KV cache, KV read from
    records and not yet joined to it, and hidden states handed from block to block."""

    def __init__(self, adapter: Adapter):
        self.text_config = adapter.text_config
        self.num_layers = adapter.num_layers
        self.cache = DynamicCache(config=self.text_config)
        self.read_kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, chunk)
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}  # (group, chunk): the group's output
        self.kv_chunks = [0] * self.num_layers  # chunks present in the cache, per layer

    def reset(self) -> None:
        """Start over (a record was rejected mid-plan and the frontier is scanned again)."""
        self.cache = DynamicCache(config=self.text_config)
        self.read_kv.clear()
        self.hidden.clear()
        self.kv_chunks = [0] * self.num_layers

    def cache_layer(self, layer: int) -> KVLayer:
        """Layer `layer` of the KV cache (every decoder layer here has full attention)."""
        return cast(KVLayer, self.cache.layers[layer])

    def extend_kv(self, layer: int, upto: int) -> None:
        """Append read KV chunks [present, upto) of `layer` to the cache (bitwise what compute made)."""
        have = self.kv_chunks[layer]
        if have >= upto:
            return
        keys, values = zip(*(self.read_kv.pop((layer, chunk)) for chunk in range(have, upto)), strict=True)
        cache_layer = self.cache_layer(layer)
        if not cache_layer.is_initialized:
            cache_layer.lazy_initialization(keys[0], values[0])
        cache_layer.keys = torch.cat([cache_layer.keys, *keys], dim=-2)
        cache_layer.values = torch.cat([cache_layer.values, *values], dim=-2)
        self.kv_chunks[layer] = upto
