"""Calibration: this machine's recovery costs, measured with the real record reader and engine.

Above the engine (it runs `Engine` on real blocks), so that the cost model the engine plans with
(flight/recovery/cost.py) imports no engine. A measured CostModel is kept in the calibration
cache (flight/recovery/calibration_cache.py), where the engine finds it at plan time
(docs/recovery.md §6).

    calibrate()   measure (or take from the cache) this machine's CostModel for a model; then
                  flight.recovery.calibration_cache.cost_model_for(model) plans with it
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from scipy.optimize import nnls
from scipy.stats import theilslopes

from common.durable import DurableFS
from common.record import Kind, encode, read_partial
from flight.checkpoint.policies import Geometry
from flight.engine import Engine, EngineOptions
from flight.model.inputs import build_inputs
from flight.model.loader import load_model
from flight.model.tiny import vocabulary
from flight.recovery import calibration_cache
from flight.recovery.cost import CostModel, ModelDims, model_bytes

#: A timed sample counts only if this process's threads spent at most this share of it runnable
#: but not running (waiting for a core): other work on the cores stretches every torch op, whose
#: intra-op barrier waits for a descheduled worker thread. On this 2-core machine next to another
#: torch process a tiny-model layer call measured 11-28 ms instead of 0.43 ms, and such rates,
#: once cached, set every later plan and the adaptive block shape.
MAX_RUNQUEUE_SHARE = 0.05
#: Bytes another process may move on the scratch device during a timed read (journal commits,
#: metadata) before the read counts as shared with other I/O; plus a sixteenth of the read.
FOREIGN_IO_SLACK_BYTES = 256 << 10
#: Measurement rounds before a calibration is declared contended (then it is not cached).
MAX_ROUNDS = 4
#: Pause between rounds: interference on a shared machine comes in bursts (a boot, a flush).
ROUND_PAUSE_S = 0.5


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads have waited for a core since they started (Linux
    /proc/<pid>/task/*/schedstat, second field, in ns); None where the kernel does not say."""
    total, seen = 0, False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
                seen = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if seen else None


def _wait_delta(before: float | None, after: float | None) -> float:
    """Run-queue wait between two readings (0 where unknown; never negative: a thread that ended
    takes its count with it)."""
    if before is None or after is None:
        return 0.0
    return max(after - before, 0.0)


def _device_stat_path(path: str) -> str | None:
    """The block device statistics of the filesystem holding `path`, None where it has none
    (tmpfs: RAM is the device; overlay and network filesystems: no single device to watch)."""
    dev = os.stat(path).st_dev
    stat = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return stat if os.path.exists(stat) else None


def _device_bytes(stat_path: str | None) -> tuple[int, int] | None:
    """(bytes read, bytes written) by the device so far; fields 3 and 7 of its stat are sectors
    of 512 bytes whatever the device's own sector size (Documentation/block/stat.rst)."""
    if stat_path is None:
        return None
    try:
        with open(stat_path) as f:
            fields = f.read().split()
        return int(fields[2]) * 512, int(fields[6]) * 512
    except (OSError, IndexError, ValueError):
        return None


def foreign_io_bytes(before: tuple[int, int] | None, after: tuple[int, int] | None, own_read: int) -> int:
    """Bytes the device moved during a timed read beyond the read itself: what other processes
    read or wrote meanwhile (0 where the device is unknown)."""
    if before is None or after is None:
        return 0
    read, written = after[0] - before[0], after[1] - before[1]
    return max(read - own_read, 0) + max(written, 0)


def read_sample_clean(sample: tuple[int, float, float, int]) -> bool:
    """A read sample (bytes, seconds, run-queue wait s, foreign device bytes) timed alone."""
    nbytes, secs, waited, foreign = sample
    return waited <= MAX_RUNQUEUE_SHARE * secs and foreign <= FOREIGN_IO_SLACK_BYTES + nbytes // 16


def compute_sample_clean(sample: tuple[int, int, int, float, float]) -> bool:
    """A block sample (layers, tokens, start, seconds, run-queue wait s) timed alone."""
    return sample[4] <= MAX_RUNQUEUE_SHARE * sample[3]


def fit_reads(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(bytes/s, seconds per read) from (bytes, seconds) samples: time = latency + bytes / bw,
    fitted by Theil-Sen (median slopes) over the fastest time of each size. Interference only
    ever adds time, so the fastest of the repeats is the one closest to the device's own cost;
    a fit over every repeat moves with whatever else ran."""
    fastest: dict[int, float] = {}
    for nbytes, secs in samples:
        fastest[nbytes] = min(secs, fastest.get(nbytes, math.inf))
    sizes = np.array(sorted(fastest), float)
    times = np.array([fastest[int(n)] for n in sizes])
    inv_bw, latency = theilslopes(times, sizes)[:2] if len(sizes) > 1 else (0.0, 0.0)
    if inv_bw <= 0:  # no usable slope: attribute everything to bandwidth
        inv_bw, latency = times.sum() / sizes.sum(), 0.0
    return float(1.0 / inv_bw), float(max(latency, 0.0))


def block_flops(dims: ModelDims, tokens: int, start: int) -> float:
    """FLOPs of one layer on `tokens` tokens from position `start` (docs/recovery.md §6)."""
    pairs = tokens * start + tokens * (tokens + 1) / 2
    return tokens * dims.flops_per_token_layer + pairs * dims.flops_per_pair_layer


def fit_compute(samples: list[tuple[int, int, int, float]], dims: ModelDims) -> tuple[float, float]:
    """(seconds per layer call, seconds per FLOP) from (layers, tokens, start, seconds) block
    samples: block time = layers * (call + FLOPs per layer / rate), fitted by non-negative least
    squares over the fastest time of each block shape (the same reason as `fit_reads`)."""
    fastest: dict[tuple[int, int, int], float] = {}
    for layers, tokens, start, secs in samples:
        fastest[(layers, tokens, start)] = min(secs, fastest.get((layers, tokens, start), math.inf))
    shapes = sorted(fastest)
    feats = np.array([[layers, layers * block_flops(dims, tokens, start)] for layers, tokens, start in shapes])
    scale = feats.max(axis=0)
    coef, _ = nnls(feats / scale, np.array([fastest[shape] for shape in shapes]))
    call_s, s_per_flop = coef / scale
    return float(call_s), float(s_per_flop)


def _drop_page_cache(path: str) -> None:
    """After fsync the pages are clean: ask the kernel to drop them so the timed read goes to the
    device, as the first read after a power cut does. (No effect on tmpfs: RAM is the device.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_reads(scratch_dir: str, sizes_mib=(1, 2, 4, 8, 16), repeats: int = 3) -> tuple[float, float, list, bool]:
    """(bytes/s, seconds per read, samples, contended): write checkpoint records of several sizes
    with the durable writer, drop them from the page cache, read them back with the record reader
    (header, commit footer, per-tensor CRC, exactly as recovery does) and fit time = latency +
    bytes/bw (`fit_reads`) over the reads timed alone: a read during which this process waited for
    a core, or the scratch device moved other processes' bytes, is left out. Rounds of `repeats`
    reads of each size run until every size has a read timed alone (at most MAX_ROUNDS); if none
    does, `contended` is True and the fit is over every read."""
    fs = DurableFS()
    device = _device_stat_path(scratch_dir)
    samples: list[tuple[int, float, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="ow-calib-", dir=scratch_dir) as tmp:
        paths = []
        for i, mib in enumerate(sizes_mib):
            t = torch.randint(-128, 127, (mib << 20,), dtype=torch.int8)
            path = os.path.join(tmp, f"r{i}.blk")
            fs.write_atomic(path, encode(Kind.PREFILL_BLOCK, {"group": 0, "chunk": i}, {"k.0": t}).chunks)
            paths.append((path, mib << 20))
        for round_ in range(MAX_ROUNDS):
            if round_:
                time.sleep(ROUND_PAUSE_S)
            for _ in range(repeats):
                for path, nbytes in paths:
                    _drop_page_cache(path)
                    file_size = os.path.getsize(path)
                    io_before, wait_before = _device_bytes(device), runqueue_wait_s()
                    start = time.perf_counter()
                    with fs.open_read(path) as f:
                        read_partial(f, {"k.0"}, os.fstat(f.fileno()).st_size)
                    secs = time.perf_counter() - start
                    waited = _wait_delta(wait_before, runqueue_wait_s())
                    foreign = foreign_io_bytes(io_before, _device_bytes(device), file_size)
                    samples.append((nbytes, secs, waited, foreign))
            clean = [s for s in samples if read_sample_clean(s)]
            if {n for n, *_ in clean} == {n for _, n in paths}:
                break
    contended = {n for n, *_ in clean} != {n for _, n in paths}
    bw, latency = fit_reads([(n, t) for n, t, *_ in (samples if contended else clean)])
    return bw, latency, samples, contended


def _block_stamper(stamps: list[tuple[int, int, float, float, float | None]]) -> Callable[..., None]:
    """Engine events that append (group, chunk, time, time after, run-queue wait) at the end of
    each prefill block; reading the run-queue wait falls between the two times, so it is charged
    to no block."""

    def events(name: str, **fields: Any) -> None:
        if name == "prefill_block_done":
            done = time.perf_counter()
            waited = runqueue_wait_s()
            stamps.append((fields["group"], fields["chunk"], done, time.perf_counter(), waited))

    return events


def measure_compute(
    model, group: int, dims: ModelDims, chunk_sizes=(16, 48), chunks: float = 3.5, repeats: int = 2
) -> tuple[float, float, list, bool]:
    """(seconds per layer call, seconds per FLOP, samples, contended) from real blocks run by the
    engine.

    A text-only prompt of `chunks` x C tokens is prefilled by `Engine` (no checkpoints) for each
    chunk size C; the time between consecutive `prefill_block_done` events is one block's compute.
    Chunk 0 is left out (it includes the lazy weight loads), and so is a block during which this
    process's threads waited for a core for more than MAX_RUNQUEUE_SHARE of it. Block time is
    fitted as
        layers * (call + FLOPs per layer / rate)        (`fit_compute`)
    with attention FLOPs counted per (query, key) pair: prompts short enough to calibrate in
    seconds cannot separate attention from the projections, so both run at the measured rate.
    Rounds of `repeats` prefills per chunk size run until every block shape has a block timed
    alone (at most MAX_ROUNDS); if none does, `contended` is True and the fit is over every block."""
    words = [w for w in vocabulary() if w.isalpha()]
    requests = []
    for chunk in chunk_sizes:
        target_tokens = int(chunks * chunk)
        prompt = " ".join(words[i % len(words)] for i in range(target_tokens))
        inputs = build_inputs(model.tokenizer, model.image_processor, [], prompt, model.adapter.image_token_id)
        # The chat template adds a few tokens: trim the prompt until the request has the length.
        while inputs.num_tokens > target_tokens and prompt:
            prompt = prompt.rsplit(" ", 1)[0]
            inputs = build_inputs(model.tokenizer, model.image_processor, [], prompt, model.adapter.image_token_id)
        requests.append((Geometry(chunk=chunk, group=group), inputs))
    samples: list[tuple[int, int, int, float, float]] = []
    shapes: set[tuple[int, int, int]] = set()
    for round_ in range(MAX_ROUNDS):
        if round_:
            time.sleep(ROUND_PAUSE_S)
        for geometry, inputs in requests:
            groups = geometry.layer_groups(model.adapter.num_layers)
            spans = geometry.token_chunks(inputs.num_tokens)
            for _ in range(repeats):
                stamps: list[tuple[int, int, float, float, float | None]] = []
                engine = Engine(
                    model,
                    EngineOptions(geometry=geometry, policy="none", async_writes=False),
                    events=_block_stamper(stamps),
                )
                with tempfile.TemporaryDirectory(prefix="ow-calib-") as ckpt:
                    engine.run(inputs, ckpt, max_new_tokens=1)
                for (g0, c0, _, t0, w0), (g, c, t, _, w) in itertools.pairwise(stamps):
                    if c == 0 or (g, c) == (g0, c0):
                        continue
                    (l0, l1), (s, e) = groups[g], spans[c]
                    samples.append((l1 - l0, e - s, s, t - t0, _wait_delta(w0, w)))
                    shapes.add((l1 - l0, e - s, s))
        clean = [x for x in samples if compute_sample_clean(x)]
        if {x[:3] for x in clean} == shapes:
            break
    contended = {x[:3] for x in clean} != shapes
    call_s, s_per_flop = fit_compute([x[:4] for x in (samples if contended else clean)], dims)
    return call_s, s_per_flop, samples, contended


def calibrate(
    model_dir: str | None = None,
    *,
    model=None,
    group: int = 2,
    device: str = "cpu",
    dtype: str | None = None,
    scratch_dir: str | None = None,
    use_cache: bool = True,
) -> CostModel:
    """Measure this machine's CostModel for a model (a directory, or an already loaded model).

    Cached as JSON in $OW_CACHE_DIR/recovery-costs.json (default ~/.cache/orbitweaver), keyed by
    the model's content hash, the CPU model and count, torch version and threads, the device, the
    dtype and the filesystem of `scratch_dir` -- put that on the checkpoint device, since its read
    bandwidth is what is measured (default: the system temp directory). A few seconds on the tiny
    and small models; instant when cached. Only samples timed alone count (`measure_reads`,
    `measure_compute`); a calibration that found none for some size or block shape after
    MAX_ROUNDS is returned with meta["contended"] and a warning, and is not cached."""
    if model is None:
        if model_dir is None:
            raise ValueError("calibrate needs a model directory or a loaded model")
        model = load_model(model_dir, device=device, dtype=dtype)
    scratch_dir = scratch_dir or tempfile.gettempdir()
    dtype_name = str(model.dtype).removeprefix("torch.")
    key = calibration_cache.model_key(model, scratch_dir)
    if use_cache:
        hit = calibration_cache.cached(key)
        if hit is not None:
            return hit
    t0 = time.perf_counter()
    dims = ModelDims.from_text_config(
        model.adapter.text_config, name=os.path.basename(model.model_dir), dtype_bytes=model.dtype.itemsize
    )
    bw, latency, read_samples, reads_contended = measure_reads(scratch_dir)
    call_s, s_per_flop, compute_samples, compute_contended = measure_compute(model, group, dims)
    measured = CostModel(
        **model_bytes(model),
        read_bytes_per_s=bw,
        read_latency_s=latency,
        layer_call_s=call_s,
        token_layer_s=s_per_flop * dims.flops_per_token_layer,
        pair_layer_s=s_per_flop * dims.flops_per_pair_layer,
        reproject_share=dims.reproject_share,
        label="native",
        meta={
            "key": key,
            "model_hash": model.content_hash,
            "dims": asdict(dims),
            "machine": calibration_cache.machine_identity(model.device.type),
            "dtype": dtype_name,
            "flops_per_s": 1.0 / s_per_flop if s_per_flop > 0 else None,
            "read_samples": len(read_samples),
            "read_samples_alone": sum(map(read_sample_clean, read_samples)),
            "compute_samples": len(compute_samples),
            "compute_samples_alone": sum(map(compute_sample_clean, compute_samples)),
            "contended": reads_contended or compute_contended,
            "seconds": round(time.perf_counter() - t0, 3),
        },
    )
    if measured.meta["contended"]:
        # Rates measured next to other work are that moment's, not this machine's: never let them
        # outlive the call (the cache has no expiry, and every later plan would read them).
        warnings.warn(
            f"calibration of {dims.name} ran next to other work on every try (reads alone "
            f"{measured.meta['read_samples_alone']}/{len(read_samples)}, blocks alone "
            f"{measured.meta['compute_samples_alone']}/{len(compute_samples)}): not cached",
            RuntimeWarning,
            stacklevel=2,
        )
    else:
        calibration_cache.store(key, measured.to_json())
    return measured
