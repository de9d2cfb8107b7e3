"""Where the simulated payload spends its time: compute per unit of work, storage, boot.

Two kinds of platform:

* `target_platform(spec, request, target, ...)`: the real model on a Jetson target, from FLOP and
  byte counts (flight/recovery/cost.py's `TargetDevice`: Orin AGX and NX), for the real-size
  figures. Prefill blocks and re-projections come from `CostModel.for_target`, the cost model
  the optimal planner itself plans with.
* `testbench_platform(...)`: the real-process testbench's emulation -- every unit paced to
  `pace_ms` (a prefill block of G layers is G units, a re-projection a quarter of one, as
  flight/engine.py paces them) or slower where the machine's real compute is slower than the
  pace, checkpoint storage throttled by token buckets of the given rates with the engine's 4 MiB
  burst, plus this machine's own per-record commit latency, and boot as measured. It exists to
  check the simulator against the real processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from flight.engine.pacing import paced_block_costs
from flight.recovery.cost import ORIN_AGX_NVME, BlockCosts, CostModel, TargetDevice

from .models import ModelSpec, Request

# Jetson Orin NX 16 GB (module data sheet): 1024 CUDA cores and 32 third-generation tensor cores
# at 918 MHz, i.e. half the AGX's GPU at 0.71 of its clock: 0.35 x the AGX's 42.5 dense bf16
# TFLOP/s. LPDDR5 at 102.4 GB/s (AGX: 204.8 GB/s). Same M.2 Key M (PCIe Gen4 x4) NVMe slot on
# the developer kit carrier, so the same storage assumption as the AGX.
ORIN_NX_NVME = TargetDevice(
    "Jetson Orin NX 16GB + NVMe (PCIe Gen3 x4 class)",
    peak_flops=42.5e12 * 0.5 * 918 / 1300,
    efficiency=0.5,
    layer_call_s=150e-6,
    read_bytes_per_s=3.5e9,
    read_latency_s=100e-6,
)
TARGETS = {"orin-agx": ORIN_AGX_NVME, "orin-nx": ORIN_NX_NVME}
MEMORY_BYTES_PER_S = {"orin-agx": 204.8e9, "orin-nx": 102.4e9}
#: Decode is bound by DRAM bandwidth: every step reads every weight and the whole KV cache once.
#: Assumed: 60 % of the peak bandwidth is reached.
MEMORY_EFFICIENCY = 0.6
#: Sustained NVMe write of a Gen3 x4 class drive (hil/testbench.py uses the same number), and the
#: cost of one durable commit: write + fsync(file) + rename + fsync(directory) -- two flushes of a
#: drive without power-loss protection. Assumed 1 ms; the figures report a band (0.25-4 ms).
NVME_WRITE_BYTES_PER_S = 2.0e9
COMMIT_LATENCY_S = 1e-3


@dataclass
class Storage:
    """Checkpoint storage: bandwidth and a fixed cost per record (write) or per read; with a
    token-bucket burst, the testbench's emulation (common.durable.ThrottledFS)."""

    write_bytes_per_s: float
    write_latency_s: float
    read_bytes_per_s: float
    read_latency_s: float
    burst_bytes: float = 0.0
    # Device bytes per byte of the payload's own data (task inputs, images) beside the checkpoint
    # records the bandwidths are for: the testbench's --emulate-data-weight (common.durable
    # ThrottledFS.weighted); 1 on a real target.
    data_weight: float = 1.0

    def data_bytes(self, nbytes: float) -> float:
        """What `nbytes` of the payload's own data cost the device, in checkpoint bytes."""
        return nbytes * self.data_weight


@dataclass
class Platform:
    name: str
    storage: Storage
    boot_s: float  # power-up -> the payload takes up a task (process, libraries, model skeleton)
    first_start_s: float  # task accepted -> started, when the payload is already up
    setup_s: float  # task started -> first unit of work (store open and scan), a TASK_INPUTS read or write apart
    vision_block_s: float  # one vision block (all images)
    vision_extra_s: float  # patch embedding + merger
    decode_step_s: float  # one decode step
    prefill: CostModel | None = None  # real sizes: block costs from the planner's cost model
    pace_s: float = 0.0  # testbench: every paced unit lasts this long
    weights_read_s: float = 0.0  # all LM weights (read by the plan, per group share)
    vision_weights_read_s: float = 0.0
    result_s: float = 0.0  # RESULT commit + GC + report, beyond the record write
    boot_by_power_up: dict = field(default_factory=dict)  # measured boot of particular power-ups (validation)
    # power-up -> the payload process starts: its storage throttle's buckets (empty then) and its
    # uptime clock (the cadence's, the window log's) start here
    process_start_s: float = 0.0
    # the process start of particular power-ups where it came later than `process_start_s`
    # (validation: a slow first boot on a loaded machine; `process_start_at`)
    process_start_by_power_up: dict = field(default_factory=dict)
    first_setup_s: float | None = None  # setup at a task's first start (inputs built); None: setup_s
    meta: dict = field(default_factory=dict)

    def boot_at(self, power_up: float) -> float:
        """Boot of the power-up at `power_up`: as measured there if known, else `boot_s`."""
        for t, boot in self.boot_by_power_up.items():
            if abs(t - power_up) < 1.0:
                return boot
        return self.boot_s

    def process_start_at(self, power_up: float) -> float:
        """Power-up -> the payload process started, for the power-up at `power_up`: as measured
        there if known, else `process_start_s`."""
        for t, start in self.process_start_by_power_up.items():
            if abs(t - power_up) < 1.0:
                return start
        return self.process_start_s

    def layer_chunk_s(self, tokens: int) -> float:
        """One decoder layer on one chunk of `tokens` (Engine.task_geometry's estimate): the pace
        where the payload is paced, else the planner's cost model."""
        if self.prefill is not None:
            return self.prefill.compute_s(1, tokens, 0)
        return self.pace_s

    def block_costs(
        self, groups, chunks, kv_bytes_per_token_layer: float = 0.0, hidden_bytes_per_token: float = 0.0
    ) -> BlockCosts:
        """What each operation of the prefill grid takes (the planner's BlockCosts shape):
        reads at the storage's bandwidth (in the simulated schedule the token bucket's burst is
        applied along the read order on top), and on the testbench the pace, through the
        engine's own `paced_block_costs` (its record sizes: `kv_bytes_per_token_layer`,
        `hidden_bytes_per_token`). Also what the payload's planner is told: it charges each read
        at the rate it gets (PrefillRestore._plan_costs), the testbench's unthrottled weights
        at their own read time."""

        if self.prefill is not None:
            model = replace(
                self.prefill, read_bytes_per_s=self.storage.read_bytes_per_s, read_latency_s=self.storage.read_latency_s
            )
            costs = model.block_costs(groups, chunks)
            return costs
        st = self.storage
        layers = np.array([l1 - l0 for l0, l1 in groups], dtype=float)[:, None]
        tokens = np.array([e - s for s, e in chunks], dtype=float)[None, :]
        shape = (len(groups), len(chunks))
        kv = st.read_latency_s + layers * tokens * kv_bytes_per_token_layer / st.read_bytes_per_s
        hidden = np.broadcast_to(st.read_latency_s + tokens * hidden_bytes_per_token / st.read_bytes_per_s, shape)
        weights = np.full(len(groups), self.weights_read_s / len(groups))
        zeros = np.zeros(shape)
        reads = BlockCosts(weights, kv, hidden.copy(), zeros, zeros.copy(), "storage")
        costs = paced_block_costs(reads, groups, self.pace_s)  # re-projections: REPROJECT_PACE_UNITS
        return replace(costs, source="testbench " + costs.source)


def vision_block_seconds(spec: ModelSpec, request: Request, target: TargetDevice) -> float:
    """One vision block over every patch of every image: projections + MLP per patch, and
    full attention within each image (pairs per image squared)."""
    v = spec.vision
    patches = request.patches(spec)
    per_image = patches / max(1, request.images)
    flops = 2.0 * v.block_params * patches + 4.0 * v.hidden * per_image * per_image * request.images
    return target.layer_call_s + flops / target.flops_per_s


def target_platform(
    spec: ModelSpec,
    request: Request,
    target_name: str = "orin-agx",
    *,
    boot_s: float = 20.0,
    commit_latency_s: float = COMMIT_LATENCY_S,
    write_bytes_per_s: float = NVME_WRITE_BYTES_PER_S,
) -> Platform:
    target = TARGETS[target_name]
    prefill = CostModel.for_target(spec.text, target)
    mem = MEMORY_BYTES_PER_S[target_name] * MEMORY_EFFICIENCY
    t = spec.text
    kv_avg = request.prompt_tokens * t.kv_bytes_per_token_layer * t.layers
    decode = (
        t.layers * target.layer_call_s + (t.layers * t.layer_bytes + t.vocab * t.hidden * t.dtype_bytes + kv_avg) / mem
    )
    vision_bytes = spec.vision.params * spec.dtype_bytes
    lm_bytes = spec.weight_bytes - vision_bytes
    storage = Storage(write_bytes_per_s, commit_latency_s, target.read_bytes_per_s, target.read_latency_s)
    return Platform(
        f"{spec.name}@{target_name}",
        storage,
        boot_s=boot_s,
        first_start_s=0.0,
        setup_s=vision_bytes / target.read_bytes_per_s,
        vision_block_s=vision_block_seconds(spec, request, target),
        vision_extra_s=2 * target.layer_call_s,
        decode_step_s=decode,
        prefill=prefill,
        weights_read_s=lm_bytes / target.read_bytes_per_s,
        vision_weights_read_s=vision_bytes / target.read_bytes_per_s,
        result_s=2 * commit_latency_s,
        meta={"target": target.name, "boot_s": boot_s, "commit_latency_s": commit_latency_s},
    )


def testbench_platform(
    pace_ms: float,
    *,
    read_mbps: float | None,
    write_mbps: float | None,
    boot_s: float,
    first_start_s: float,
    setup_s: float,
    commit_latency_s: float,
    native_write_bytes_per_s: float = 1.0e9,
    unit_s: dict | None = None,
    result_s: float = 0.0,
    burst_bytes: float = 4 << 20,
    data_weight: float = 1.0,
) -> Platform:
    """`unit_s`: seconds per unit of work by phase ("vision", "prefill" per layer-chunk, "decode")
    where the payload's real compute is slower than the pace (a loaded machine); default: the pace."""
    pace = pace_ms / 1000.0
    unit = {"vision": pace, "prefill": pace, "decode": pace, **{k: max(pace, v) for k, v in (unit_s or {}).items()}}
    write = write_mbps * 1e6 if write_mbps else native_write_bytes_per_s
    read = read_mbps * 1e6 if read_mbps else 1.5e9
    throttled = bool(read_mbps or write_mbps)
    storage = Storage(
        write, commit_latency_s, read, 0.0, burst_bytes if throttled else 0.0, data_weight if throttled else 1.0
    )
    return Platform(
        "testbench",
        storage,
        boot_s=boot_s,
        first_start_s=first_start_s,
        setup_s=setup_s,
        vision_block_s=unit["vision"],
        vision_extra_s=0.0,
        decode_step_s=unit["decode"],
        pace_s=unit["prefill"],
        result_s=result_s,
        meta={
            "pace_ms": pace_ms,
            "read_mbps": read_mbps,
            "write_mbps": write_mbps,
            "data_weight": storage.data_weight,
            "unit_s": unit,
        },
    )
