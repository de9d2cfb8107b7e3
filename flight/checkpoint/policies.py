"""Checkpoint policies: what to persist, when. One engine runs them all, so comparisons are fair.

A policy answers a few questions the engine asks at each unit of work; it never touches tensors
or files itself. The engine (flight/engine/) hands the chosen state to the store, and recovery
(flight/recovery/) restores whatever records the policy left.

    orbitweaver   vision state every k blocks (A/B buffers) + the vision output; prefill blocks of
                  G layers x C tokens holding KV and the group's boundary hidden state; one decode
                  record every D steps.
    none          no checkpoints (the request restarts after a cut); only MANIFEST and RESULT.

Baselines (docs/baselines.md) are further subclasses choosing other answers: `sonic-layer`,
`sonic-chunk` and `hcache` as their own papers describe them (SONIC's commit on the compute
path; HCache's hidden states and layer-wise restore), and `sonic-layer+`, `sonic-chunk+`,
`hcache+`, the same records strengthened with OrbitWeaver's background writer and planner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar


@dataclass(frozen=True)
class Geometry:
    """Units of work and of persistence."""

    chunk: int = 1024  # C: prompt tokens per prefill chunk (changes the bits: pinned in MANIFEST)
    group: int = 4  # G: decoder layers per prefill block
    decode_every: int = 16  # D: decode steps per decode record
    vision_every: int = 4  # k: vision blocks between vision checkpoints

    def __post_init__(self):
        for name in ("chunk", "group", "decode_every", "vision_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1")

    def layer_groups(self, num_layers: int) -> list[tuple[int, int]]:
        return [(l0, min(num_layers, l0 + self.group)) for l0 in range(0, num_layers, self.group)]

    def token_chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        return [(s, min(num_tokens, s + self.chunk)) for s in range(0, num_tokens, self.chunk)]


@dataclass(frozen=True)
class PrefillPersist:
    kv: bool
    boundary_hidden: bool


class Policy:
    name = "abstract"
    description = ""
    #: Whether this policy takes the adaptive cadence (early records when a cut is likely,
    #: cadence.py) and has it by default. A baseline keeps the cadence its definition gives
    #: (docs/baselines.md), so only a policy that says so here adapts.
    adaptive_cadence: ClassVar[bool] = False

    def geometry(self, requested: Geometry, num_layers: int) -> Geometry:
        """The geometry this policy runs with (baselines fix G, for example)."""
        return requested

    def writes_checkpoints(self) -> bool:
        return True

    def vision_state_due(self, blocks_done: int, total: int, geometry: Geometry) -> bool:
        """Persist the vision hidden state after `blocks_done` blocks?"""
        return blocks_done < total and blocks_done % geometry.vision_every == 0

    def persist_vision_out(self) -> bool:
        return True

    def prefill_block(self, group: int, chunk: int, num_groups: int, num_chunks: int) -> PrefillPersist | None:
        """What to persist when prefill block (group, chunk) completes; None = nothing."""
        return PrefillPersist(kv=True, boundary_hidden=True)

    def layer_input_hidden(self) -> bool:
        """Persist every layer's input hidden state per chunk (HCache-style restore)."""
        return False

    def decode_record_due(self, steps_since_record: int, geometry: Geometry, finished: bool) -> bool:
        return steps_since_record >= geometry.decode_every or (finished and steps_since_record > 0)

    def synchronous_commits(self) -> bool:
        """Commit each record on the compute path (write + fsync before the next unit of work), as
        an intermittent-computing task runtime does; False: OrbitWeaver's background writer."""
        return False

    def recovery(self, requested_planner: str, overlap: bool) -> tuple[str, bool]:
        """(planner, overlap reads with compute) this policy restores prefill with; OrbitWeaver
        and the strengthened baselines take what the operator asked for."""
        return requested_planner, overlap


class OrbitWeaverPolicy(Policy):
    name = "orbitweaver"
    adaptive_cadence = True
    description = (
        "phase-aware: vision state every k blocks, prefill blocks of G layers x C tokens "
        "(KV + boundary hidden), decode record every D steps"
    )


class NoCheckpointPolicy(Policy):
    name = "none"
    description = "no checkpoints: a cut restarts the request from the beginning"

    def writes_checkpoints(self) -> bool:
        return False

    def vision_state_due(self, blocks_done, total, geometry):
        return False

    def persist_vision_out(self):
        return False

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        return None

    def decode_record_due(self, steps_since_record, geometry, finished):
        return False


# ---- the paper's baselines, as their own papers define them (docs/baselines.md) ---------------
class SonicLayerPolicy(Policy):
    """SONIC (Gobieski et al., ASPLOS'19) applied per layer: every task -- one vision block, one
    decoder layer on one prefill chunk, one decode step -- commits its outputs to non-volatile
    storage before the next task starts, as an intermittent-computing task runtime does. A
    layer's outputs are its KV for the chunk and its output hidden state, so over a whole prefill
    the full-sequence hidden state is persisted after every layer. Restore: read the committed
    state, then continue in task order (no overlap)."""

    name = "sonic-layer"
    description = (
        "SONIC per layer: after every vision block, every layer of every chunk (KV + hidden) and every "
        "decode step, committed synchronously on the compute path; restore then continue"
    )

    def geometry(self, requested, num_layers):
        return replace(requested, group=1, vision_every=1, decode_every=1)

    def synchronous_commits(self) -> bool:
        return True

    def recovery(self, requested_planner: str, overlap: bool) -> tuple[str, bool]:
        return "chunk-first", False


class SonicChunkPolicy(Policy):
    """SONIC applied per chunk: a task is one chunk through all layers (its KV of every layer is
    committed), one vision block (the vision phase is checkpointed as tasks too), or one decode
    step; commits are synchronous, restore reads then continues."""

    name = "sonic-chunk"
    description = (
        "SONIC per chunk: after every vision block, every whole chunk (KV of all layers) and every decode "
        "step, committed synchronously on the compute path; restore then continue"
    )

    def geometry(self, requested, num_layers):
        return replace(requested, group=num_layers, vision_every=1, decode_every=1)

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        # The final hidden state is kept for the last chunk only: the first token needs it.
        return PrefillPersist(kv=True, boundary_hidden=chunk == num_chunks - 1)

    def synchronous_commits(self) -> bool:
        return True

    def recovery(self, requested_planner: str, overlap: bool) -> tuple[str, bool]:
        return "chunk-first", False


class HCachePolicy(Policy):
    """HCache (Gao et al., EuroSys'25) as its paper describes it: per layer, the hidden state the
    layer's KV is projected from is saved, in two stages (a snapshot the compute hands over, then
    a background flush: off the compute path); restore projects KV from the saved hidden states,
    and its bubble-free scheduler gives the first layers to a resource-complementary method --
    token recomputation, on hardware where reading hidden states is the bottleneck -- so that
    I/O and compute finish together, layer by layer (a layer-first pipeline).

    Here: layers 0..k-2 persist nothing (recomputed from the tokens), layer k-1 and later persist
    their output hidden state (the next layer's input; layer k-1's own KV is then projected from
    the recomputed input), the last layer a marker (its KV is projected from layer L-2's output;
    the final hidden state of the last chunk for the first token). k comes from the same balance
    rule on the reference payload (`hcache_recompute_layers`). Decode: KV slices every 64 steps,
    HCache's storage chunk of 64 tokens."""

    name = "hcache"
    description = (
        "HCache: per-layer hidden states saved off the compute path, the first layers recomputed from "
        "tokens (bubble-free split), KV projected at restore in a layer-by-layer pipeline"
    )
    STORAGE_CHUNK_TOKENS = 64
    recompute_layers = 0

    def geometry(self, requested, num_layers):
        self.recompute_layers = hcache_recompute_layers(num_layers)
        return replace(requested, group=1, decode_every=self.STORAGE_CHUNK_TOKENS)

    def vision_state_due(self, blocks_done, total, geometry):
        return False  # HCache saves the LLM's state; the vision output is the LM input it needs

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        last_chunk = chunk == num_chunks - 1
        if group == num_groups - 1:  # a marker: the block is done; its KV is projected from layer L-2's output
            return PrefillPersist(kv=False, boundary_hidden=last_chunk)
        if group < self.recompute_layers - 1:
            return None  # recomputed from the tokens on restore
        return PrefillPersist(kv=False, boundary_hidden=True)

    def recovery(self, requested_planner: str, overlap: bool) -> tuple[str, bool]:
        return "layer-first", overlap


def hcache_recompute_layers(num_layers: int, costs=None) -> int:
    """HCache's bubble-free split (§4 of its paper, our reading): the number k of leading layers
    restored by token recomputation that minimises max(I/O, compute) of a full restore, where
    the other L - k layers read their hidden state (I/O) and project it to KV (compute). `costs`
    = (read hidden, project, recompute) seconds per layer-chunk; default: the reference payload
    (Qwen3-VL-2B on the Orin target, chunks of 1024 tokens)."""
    if costs is None:
        costs = _reference_layer_chunk_costs()
    read, project, recompute = costs
    best = min(
        range(num_layers + 1),
        key=lambda k: (max((num_layers - k) * read, k * recompute + (num_layers - k) * project), k),
    )
    return best


def _reference_layer_chunk_costs() -> tuple[float, float, float]:
    # lazy: the cost model loads numpy and the planners; `ow --help` loads this module for its choices
    from flight.recovery.cost import REFERENCE_CHUNK, REFERENCE_MODEL, CostModel, even_chunks

    model = CostModel.for_target(REFERENCE_MODEL)
    block = model.block_costs([(0, 1)], even_chunks(2 * REFERENCE_CHUNK, REFERENCE_CHUNK))
    assert block.reproject is not None  # BlockCosts derives it from compute when not given
    return float(block.hidden[0, 1]), float(block.reproject[0, 1]), float(block.compute[0, 1])


# ---- the same baselines, strengthened with OrbitWeaver's machinery ----------------------------
class SonicLayerPlusPolicy(Policy):
    """SONIC-layer's records, written by OrbitWeaver's background writer (optional vision states,
    `vision.out` in the background) and restored by OrbitWeaver's planner and overlapped executor."""

    name = "sonic-layer+"
    description = "sonic-layer's records with OrbitWeaver's background writer and recovery planner (strengthened)"

    def geometry(self, requested, num_layers):
        return replace(requested, group=1, vision_every=1, decode_every=1)


class SonicChunkPlusPolicy(Policy):
    """SONIC-chunk's prefill records (vision output only), with OrbitWeaver's writer and planner."""

    name = "sonic-chunk+"
    description = "whole-chunk KV records, vision output only, OrbitWeaver's writer and recovery planner (strengthened)"

    def geometry(self, requested, num_layers):
        return replace(requested, group=num_layers)

    def vision_state_due(self, blocks_done, total, geometry):
        return False

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        return PrefillPersist(kv=True, boundary_hidden=chunk == num_chunks - 1)


class HCachePlusPolicy(Policy):
    """HCache-style records split every other layer between KV and hidden state, restored by
    OrbitWeaver's planner, which overlaps the re-projections with the reads (strengthened)."""

    name = "hcache+"
    description = (
        "per layer and chunk: the hidden state for re-projected layers, KV for the others, OrbitWeaver's "
        "writer and recovery planner (strengthened)"
    )
    #: Every `reproject_every`-th layer's KV is re-projected from its input hidden state: for Qwen-VL
    #: GQA layers re-projection and reading take about the same time per layer on the payload
    #: computers we target, hence one layer in two (docs/baselines.md).
    reproject_every = 2

    def geometry(self, requested, num_layers):
        return replace(requested, group=1)

    def reprojected(self, layer: int) -> bool:
        return layer % self.reproject_every == self.reproject_every - 1

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        keep_hidden = self.reprojected(group + 1) or (group == num_groups - 1 and chunk == num_chunks - 1)
        return PrefillPersist(kv=not self.reprojected(group), boundary_hidden=keep_hidden)


BASELINES = ("sonic-layer", "sonic-chunk", "hcache")
STRENGTHENED = {"sonic-layer": "sonic-layer+", "sonic-chunk": "sonic-chunk+", "hcache": "hcache+"}


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        OrbitWeaverPolicy,
        NoCheckpointPolicy,
        SonicLayerPolicy,
        SonicChunkPolicy,
        HCachePolicy,
        SonicLayerPlusPolicy,
        SonicChunkPlusPolicy,
        HCachePlusPolicy,
    )
}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def takes_adaptive_cadence(name: str) -> bool:
    """Whether the policy named `name` takes the adaptive cadence (False for an unknown name:
    its own check says what is wrong with it)."""
    cls = POLICIES.get(name)
    return cls is not None and cls.adaptive_cadence


def adaptive_policies() -> list[str]:
    """The names of the policies that take the adaptive cadence (for messages)."""
    return sorted(name for name, cls in POLICIES.items() if cls.adaptive_cadence)


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None


__all__ = [
    "Geometry",
    "PrefillPersist",
    "Policy",
    "OrbitWeaverPolicy",
    "NoCheckpointPolicy",
    "SonicLayerPolicy",
    "SonicChunkPolicy",
    "HCachePolicy",
    "SonicLayerPlusPolicy",
    "SonicChunkPlusPolicy",
    "HCachePlusPolicy",
    "BASELINES",
    "STRENGTHENED",
    "POLICIES",
    "adaptive_policies",
    "get_policy",
    "takes_adaptive_cadence",
    "register",
    "replace",
    "hcache_recompute_layers",
]
