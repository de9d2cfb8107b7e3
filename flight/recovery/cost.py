"""What recovery operations cost, in seconds: the numbers the `optimal` planner and the simulator use.

Three layers, from concrete to abstract:

    BlockCosts   seconds per operation of one recovery problem: read the weights of group g, read
                 the KV / boundary hidden state of block (g, c), compute block (g, c). This is what
                 `RecoveryProblem.costs` carries (as plain lists, see `BlockCosts.as_dict`).
    CostModel    per-model, per-machine rates (bytes per layer, per token; read bandwidth and
                 latency; compute seconds per layer call, per token, per attention pair) that turn
                 any layer grouping and token chunking into BlockCosts.

This module is arithmetic on dimensions and rates and imports no engine. Measuring a CostModel
on this machine (it runs the engine) is bench/calibration.py, above the engine; the measured
models are kept by flight/recovery/calibration_cache.py, which the engine reads at plan time
(docs/recovery.md §6).

The target-emulated mode (docs/recovery.md §7) rescales reads so that the read-to-compute time
ratio is that of the target payload (Jetson AGX Orin + NVMe) while compute stays as measured.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .plan import ReadOp, RecoveryProblem

COST_KEYS = ("weights", "kv", "hidden", "compute")
OPTIONAL_COST_KEYS = ("reproject",)  # absent: re-projection costs REPROJECT_COST_SHARE of the block's compute
#: The planner's default share of a block's compute that rebuilding its KV from its input hidden
#: state costs, when a problem's costs carry no `reproject` table. Counted as the K and V
#: projection weights over all the layer's weights (`ModelDims.reproject_share`): for Qwen3-VL-2B
#: 2*2048*1024 of ~50 M, about a tenth. A planning estimate only; the pace emulation charges
#: its own share (`REPROJECT_PACE_UNITS`, flight/engine/pacing.py; docs/recovery.md).
REPROJECT_COST_SHARE = 0.1


# ---------------------------------------------------------------------------------------------
# Per-problem costs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockCosts:
    """Seconds per operation of one recovery problem (arrays indexed by group, chunk)."""

    weights: np.ndarray  # (NG,)     read the weights of group g
    kv: np.ndarray  # (NG, NC)  read the KV of block (g, c)
    hidden: np.ndarray  # (NG, NC)  read the boundary hidden state of block (g, c)
    compute: np.ndarray  # (NG, NC)  compute block (g, c)
    reproject: np.ndarray | None = None  # (NG, NC)  rebuild block (g, c)'s KV from its input hidden state
    source: str = ""

    def __post_init__(self):
        if self.reproject is None:
            object.__setattr__(self, "reproject", self.compute * REPROJECT_COST_SHARE)

    @functools.cached_property
    def _tables(self) -> dict[str, list]:
        """Plain-float copies for the planners' per-operation lookups (numpy scalar indexing
        costs several times a list's, and planning looks up every operation many times)."""
        assert self.reproject is not None  # set in __post_init__
        return {
            "weights": self.weights.tolist(),
            "kv": self.kv.tolist(),
            "hidden": self.hidden.tolist(),
            "block": self.compute.tolist(),
            "reproject": self.reproject.tolist(),
        }

    @property
    def shape(self) -> tuple[int, int]:
        return self.kv.shape

    def read_s(self, op: ReadOp) -> float:
        what, group, chunk = op
        if what == "weights":
            return self._tables["weights"][group]
        if what == "kv" or what == "hidden":
            return self._tables[what][group][chunk]
        raise ValueError(f"unknown read {what!r}")

    def compute_s(self, group: int, chunk: int, kind: str = "block") -> float:
        return self._tables["block" if kind == "block" else "reproject"][group][chunk]

    def as_dict(self) -> dict:
        """The JSON-able form stored in `RecoveryProblem.costs`."""
        return {
            "weights": self.weights.tolist(),
            "kv": self.kv.tolist(),
            "hidden": self.hidden.tolist(),
            "compute": self.compute.tolist(),
            "reproject": self._tables["reproject"],
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, costs: dict, num_groups: int, num_chunks: int) -> BlockCosts:
        """Parse `RecoveryProblem.costs`: each of weights / kv / hidden / compute (and optionally
        reproject) may be a scalar (same for every operation), a per-group list, or a groups x
        chunks table."""
        missing = [k for k in COST_KEYS if k not in costs]
        if missing:
            raise ValueError(f"recovery costs lack {', '.join(missing)}")
        shape = (num_groups, num_chunks)

        def table(key):
            a = np.asarray(costs[key], dtype=np.float64)
            if a.ndim == 1 and a.shape[0] == num_groups and key != "weights":
                a = a[:, None]
            try:
                a = np.broadcast_to(a, (num_groups,) if key == "weights" else shape).copy()
            except ValueError:
                raise ValueError(
                    f"recovery costs {key!r} has shape {a.shape}, expected "
                    f"{(num_groups,) if key == 'weights' else shape}"
                ) from None
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"recovery costs {key!r} must be finite and non-negative")
            return a

        return cls(
            table("weights"),
            table("kv"),
            table("hidden"),
            table("compute"),
            table("reproject") if "reproject" in costs else None,
            str(costs.get("source", "")),
        )

    @classmethod
    def for_problem(cls, problem: RecoveryProblem) -> BlockCosts:
        """The problem's own costs, or the reference payload's when it carries none."""
        if problem.costs:
            return cls.from_dict(problem.costs, problem.num_groups, problem.num_chunks)
        return reference_costs(problem.num_groups, problem.num_chunks)


# ---------------------------------------------------------------------------------------------
# Model dimensions (bytes and FLOPs) and the target device
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    """The decoder dimensions that set recovery costs."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 2 * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden  # + the two RMSNorm weights

    @property
    def layer_bytes(self) -> int:
        return self.layer_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.hidden * self.dtype_bytes

    @property
    def flops_per_token_layer(self) -> float:
        return 2.0 * self.layer_params  # one multiply-add per weight

    @property
    def reproject_share(self) -> float:
        return 2 * self.hidden * self.kv_heads * self.head_dim / self.layer_params

    @property
    def flops_per_pair_layer(self) -> float:
        return 4.0 * self.heads * self.head_dim  # QK^T and AV for one (query, key) pair

    @classmethod
    def from_text_config(cls, text_config, name: str = "", dtype_bytes: int = 2) -> ModelDims:
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        return cls(
            name or getattr(text_config, "model_type", "model"),
            text_config.num_hidden_layers,
            text_config.hidden_size,
            heads,
            text_config.num_key_value_heads,
            head_dim,
            text_config.intermediate_size,
            text_config.vocab_size,
            dtype_bytes,
        )


# Public dimensions of the Qwen3-VL language models (config.json of the released checkpoints).
MODELS = {
    "qwen3-vl-2b": ModelDims("qwen3-vl-2b", 28, 2048, 16, 8, 128, 6144, 151936),
    "qwen3-vl-4b": ModelDims("qwen3-vl-4b", 36, 2560, 32, 8, 128, 9728, 151936),
    "qwen3-vl-8b": ModelDims("qwen3-vl-8b", 36, 4096, 32, 8, 128, 12288, 151936),
}


@dataclass(frozen=True)
class TargetDevice:
    """A payload computer, from public specifications (docs/recovery.md §7)."""

    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    efficiency: float  # fraction of peak that prefill GEMMs reach
    layer_call_s: float  # fixed cost of one decoder-layer call (kernel launches)
    read_bytes_per_s: float  # sequential read of the checkpoint / weight storage
    read_latency_s: float  # fixed cost of one read operation (open, header, first I/O)

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.efficiency


# Jetson AGX Orin 64 GB (technical brief): 64 third-generation tensor cores, 170 sparse INT8 TOPS
# on the GPU = 85 dense INT8 TOPS = 42.5 dense FP16/BF16 TFLOP/s at 1.3 GHz. NVMe on its PCIe
# Gen4 x4 M.2 slot: a Gen3 x4 class drive (3.5 GB/s sequential read, ~100 us per command
# including the file open and record header). Half of peak for prefill GEMMs and ~15 kernels of
# ~10 us per decoder layer call are assumptions, stated in docs/recovery.md.
ORIN_AGX_NVME = TargetDevice(
    "Jetson AGX Orin 64GB + NVMe (PCIe Gen3 x4 class)",
    peak_flops=42.5e12,
    efficiency=0.5,
    layer_call_s=150e-6,
    read_bytes_per_s=3.5e9,
    read_latency_s=100e-6,
)


# ---------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Rates that turn a layer grouping and token chunking into BlockCosts.

    Reading n bytes takes `read_latency_s + n / read_bytes_per_s`. Computing `layers` decoder
    layers on `tokens` tokens starting at position `start` takes
        layers * (layer_call_s + tokens * token_layer_s + pairs * pair_layer_s),
        pairs = tokens * start + tokens * (tokens + 1) / 2   (causal attention: query, key pairs)
    so for equal chunks a block costs a + b*c: attention grows with the chunk index c.
    """

    layer_weight_bytes: tuple[int, ...]  # per decoder layer
    embed_weight_bytes: int  # read with group 0 (token embeddings)
    head_weight_bytes: int  # read with the last group (final norm, LM head)
    kv_bytes_per_token_layer: int
    hidden_bytes_per_token: int
    read_bytes_per_s: float
    read_latency_s: float
    layer_call_s: float
    token_layer_s: float
    pair_layer_s: float
    reproject_share: float = REPROJECT_COST_SHARE  # K/V projection weights / all layer weights
    label: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_weight_bytes)

    def read_s(self, nbytes: float) -> float:
        return self.read_latency_s + nbytes / self.read_bytes_per_s

    def compute_s(self, layers: int, tokens: int, start: int) -> float:
        pairs = tokens * start + tokens * (tokens + 1) / 2.0
        return layers * (self.layer_call_s + tokens * self.token_layer_s + pairs * self.pair_layer_s)

    def group_weight_bytes(self, groups: list[tuple[int, int]]) -> list[int]:
        out = [sum(self.layer_weight_bytes[l0:l1]) for l0, l1 in groups]
        out[0] += self.embed_weight_bytes
        out[-1] += self.head_weight_bytes
        return out

    def block_costs(self, groups: list[tuple[int, int]], chunks: list[tuple[int, int]]) -> BlockCosts:
        """Costs for layer groups [(l0, l1), ...] and token chunks [(s, e), ...]."""
        if not groups or not chunks:
            raise ValueError("need at least one layer group and one token chunk")
        if groups[-1][1] > self.num_layers:
            raise ValueError(f"groups reach layer {groups[-1][1]} but the model has {self.num_layers}")
        layers = np.array([l1 - l0 for l0, l1 in groups], dtype=np.float64)[:, None]
        tokens = np.array([e - s for s, e in chunks], dtype=np.float64)[None, :]
        starts = np.array([s for s, _ in chunks], dtype=np.float64)[None, :]
        weights = self.weights_read_s(groups)
        kv = self.read_latency_s + layers * tokens * self.kv_bytes_per_token_layer / self.read_bytes_per_s
        hidden = np.broadcast_to(
            self.read_latency_s + tokens * self.hidden_bytes_per_token / self.read_bytes_per_s, kv.shape
        ).copy()
        pairs = tokens * starts + tokens * (tokens + 1) / 2.0
        compute = layers * (self.layer_call_s + tokens * self.token_layer_s + pairs * self.pair_layer_s)
        reproject = layers * (self.layer_call_s + tokens * self.token_layer_s * self.reproject_share)
        return BlockCosts(weights, kv, hidden, compute, reproject, self.label)

    def weights_read_s(self, groups: list[tuple[int, int]]) -> np.ndarray:
        """Seconds to read each layer group's weights at this model's read rate."""
        return np.array([self.read_s(b) for b in self.group_weight_bytes(groups)])

    def problem_costs(self, groups: list[tuple[int, int]], chunks: list[tuple[int, int]]) -> dict:
        """The dict to put in `RecoveryProblem.costs`."""
        return self.block_costs(groups, chunks).as_dict()

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def for_target(cls, dims: ModelDims, target: TargetDevice = ORIN_AGX_NVME) -> CostModel:
        """What the target device would take, from FLOP and byte counts."""
        embed = dims.vocab * dims.hidden * dims.dtype_bytes
        return cls(
            (dims.layer_bytes,) * dims.layers,
            embed,
            embed + dims.hidden * dims.dtype_bytes,
            dims.kv_bytes_per_token_layer,
            dims.hidden_bytes_per_token,
            target.read_bytes_per_s,
            target.read_latency_s,
            target.layer_call_s,
            dims.flops_per_token_layer / target.flops_per_s,
            dims.flops_per_pair_layer / target.flops_per_s,
            dims.reproject_share,
            label=f"target:{target.name}",
            meta={"model": dims.name, "target": asdict(target)},
        )

    def with_rates_of(
        self, rates: CostModel, dims_from: ModelDims | None = None, dims_to: ModelDims | None = None, label: str = ""
    ) -> CostModel:
        """This model's bytes with another machine's read rates and compute rates; compute is
        scaled by FLOPs per token / per pair when the two models differ (dims_from -> dims_to)."""
        tok = pair = 1.0
        if dims_from is not None and dims_to is not None:
            tok = dims_to.flops_per_token_layer / dims_from.flops_per_token_layer
            pair = dims_to.flops_per_pair_layer / dims_from.flops_per_pair_layer
        return replace(
            self,
            read_bytes_per_s=rates.read_bytes_per_s,
            read_latency_s=rates.read_latency_s,
            layer_call_s=rates.layer_call_s,
            token_layer_s=rates.token_layer_s * tok,
            pair_layer_s=rates.pair_layer_s * pair,
            label=label or rates.label,
            meta={**self.meta, "rates_from": rates.label},
        )

    def target_emulated(self, target_model: CostModel, layers: int, tokens: int) -> CostModel:
        """Keep this (measured) compute; scale the target's reads by the ratio of this machine's
        compute time to the target's for a reference block (`layers` x `tokens`, second chunk),
        so that every read-to-compute ratio is the target's. `read_bytes_per_s` of the result is
        the bandwidth to give the storage emulation (common.durable.ThrottledFS)."""
        slow = self.compute_s(layers, tokens, tokens) / target_model.compute_s(layers, tokens, tokens)
        return replace(
            self,
            read_bytes_per_s=target_model.read_bytes_per_s / slow,
            read_latency_s=target_model.read_latency_s * slow,
            label="target-emulated",
            meta={**self.meta, "compute_slowdown_vs_target": slow, "target": target_model.label},
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_weight_bytes"] = list(self.layer_weight_bytes)
        return d

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        return cls(**{**d, "layer_weight_bytes": tuple(d["layer_weight_bytes"])})


def even_groups(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """`num_groups` layer groups of ceil(L / NG) layers (the last may be shorter), as the engine
    groups layers (Geometry.layer_groups)."""
    size = math.ceil(num_layers / num_groups)
    groups = [(l0, min(num_layers, l0 + size)) for l0 in range(0, num_layers, size)]
    if len(groups) != num_groups:
        raise ValueError(f"{num_layers} layers cannot form {num_groups} groups of equal size")
    return groups


def even_chunks(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(num_tokens, s + chunk)) for s in range(0, num_tokens, chunk)]


REFERENCE_MODEL = MODELS["qwen3-vl-2b"]
REFERENCE_CHUNK = 1024


def reference_costs(num_groups: int, num_chunks: int) -> BlockCosts:
    """Costs when a problem carries none: the reference payload (Qwen3-VL-2B on the Orin target,
    chunks of 1024 tokens) with its layers spread over the problem's groups (more groups than
    layers: one layer each). Only ratios matter to the planner, and these are the deployment's."""
    layers = max(REFERENCE_MODEL.layers, num_groups)
    # floor-spaced boundaries: every group non-empty, sizes differ by at most one layer
    groups = [(g * layers // num_groups, (g + 1) * layers // num_groups) for g in range(num_groups)]
    model = CostModel.for_target(replace(REFERENCE_MODEL, layers=layers))
    costs = model.block_costs(groups, even_chunks(num_chunks * REFERENCE_CHUNK, REFERENCE_CHUNK))
    return replace(costs, source="reference:qwen3-vl-2b@orin")


def native_and_emulated(
    calibrated: CostModel,
    dims: ModelDims | None = None,
    target: TargetDevice = ORIN_AGX_NVME,
    group: int = 4,
    chunk: int = REFERENCE_CHUNK,
) -> tuple[CostModel, CostModel]:
    """The two benchmark columns for a model of dimensions `dims` (default: the calibrated one):
    native (this machine's measured rates, compute scaled by FLOPs) and target-emulated (same
    compute, reads at the target's read-to-compute ratio)."""
    calibrated_dims = ModelDims(**calibrated.meta["dims"])
    dims = dims or calibrated_dims
    target_model = CostModel.for_target(dims, target)
    native = target_model.with_rates_of(calibrated, calibrated_dims, dims, label="native")
    return native, native.target_emulated(target_model, group, chunk)


def model_bytes(model) -> dict:
    """Byte counts of a loaded model (flight.model.loader.LoadedModel), as recovery reads them."""
    a, w = model.adapter, model.weights
    tc = a.text_config
    itemsize = model.dtype.itemsize
    heads = tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    layers = tuple(sum(w.module_nbytes(m) for m in a.layer_modules(layer)) for layer in range(a.num_layers))
    return {
        "layer_weight_bytes": layers,
        "embed_weight_bytes": sum(w.module_nbytes(m) for m in a.embed_modules()),
        "head_weight_bytes": sum(w.module_nbytes(m) for m in a.head_modules()),
        "kv_bytes_per_token_layer": 2 * tc.num_key_value_heads * head_dim * itemsize,
        "hidden_bytes_per_token": tc.hidden_size * itemsize,
    }
