"""Calibration's fits and its interference filter, on synthetic timings (no wall time measured).

Interference on a shared machine only ever adds time; the fits must recover the rates of the
samples timed alone whatever the other repeats say (docs/recovery.md §6)."""

import itertools

import pytest

from bench import calibration
from flight.recovery.cost import MODELS, ModelDims

MIB = 1 << 20
TINY = ModelDims(
    "tiny", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=324, dtype_bytes=4
)


def read_time(nbytes: int, bandwidth: float, latency: float) -> float:
    return latency + nbytes / bandwidth


def test_fit_reads_recovers_bandwidth_and_latency_in_bytes_and_seconds():
    bandwidth, latency = 2.5e9, 4e-4  # bytes/s, s
    sizes = [mib * MIB for mib in (1, 2, 4, 8, 16)]
    samples = [(n, read_time(n, bandwidth, latency)) for n in sizes]
    assert calibration.fit_reads(samples) == pytest.approx((bandwidth, latency), rel=1e-9)
    # units: 16 MiB in 16 ms, nothing else, is 1.048576 GB/s (bytes per second, not MiB or ms)
    assert calibration.fit_reads([(n, n / MIB * 1e-3) for n in sizes]) == pytest.approx((1.048576e9, 0.0), abs=1e-12)


def test_fit_reads_takes_the_fastest_repeat_of_each_size():
    bandwidth, latency = 2.5e9, 4e-4
    sizes = [mib * MIB for mib in (1, 2, 4, 8, 16)]
    samples = []
    for repeat, n in itertools.product(range(3), sizes):
        clean = read_time(n, bandwidth, latency)
        # two of three repeats shared the disk with a flush: 4x to 25x longer, more so for big reads
        stretch = 1.0 if repeat == (n // MIB) % 3 else 4.0 + (n // MIB)
        samples.append((n, clean * stretch))
    assert calibration.fit_reads(samples) == pytest.approx((bandwidth, latency), rel=1e-9)


def block_time(dims: ModelDims, layers: int, tokens: int, start: int, call_s: float, s_per_flop: float) -> float:
    return layers * (call_s + s_per_flop * calibration.block_flops(dims, tokens, start))


@pytest.mark.parametrize("dims", [TINY, MODELS["qwen3-vl-2b"]], ids=["tiny", "qwen3-vl-2b"])
def test_fit_compute_recovers_call_and_flop_rate_from_the_fastest_blocks(dims):
    call_s, s_per_flop = 4.3e-4, 1.0 / 1.2e11  # 0.43 ms per layer call, 120 GFLOP/s
    shapes = [(2, 16, 16), (2, 16, 32), (2, 8, 48), (2, 48, 48), (2, 48, 96), (2, 24, 144)]
    samples = []
    for repeat, (layers, tokens, start) in itertools.product(range(4), shapes):
        clean = block_time(dims, layers, tokens, start, call_s, s_per_flop)
        # another torch process on the cores: every op waits for a descheduled worker thread,
        # a fixed stretch per call that dwarfs the work (what the cached rates recorded)
        contended = clean + layers * 0.2
        samples.append((layers, tokens, start, clean if repeat == start % 4 else contended))
    fitted_call, fitted_s_per_flop = calibration.fit_compute(samples, dims)
    assert fitted_call == pytest.approx(call_s, rel=1e-6)
    assert fitted_s_per_flop == pytest.approx(s_per_flop, rel=1e-6)


def test_samples_timed_next_to_other_work_are_left_out():
    share = calibration.MAX_RUNQUEUE_SHARE
    # compute: (layers, tokens, start, seconds, run-queue wait)
    assert calibration.compute_sample_clean((2, 16, 16, 1e-3, 0.0))
    assert calibration.compute_sample_clean((2, 16, 16, 1e-3, share * 1e-3))
    assert not calibration.compute_sample_clean((2, 16, 16, 1e-3, 2 * share * 1e-3))
    # reads: (bytes, seconds, run-queue wait, bytes other processes moved on the device)
    slack = calibration.FOREIGN_IO_SLACK_BYTES + 16 * MIB // 16
    assert calibration.read_sample_clean((16 * MIB, 8e-3, 0.0, slack))
    assert not calibration.read_sample_clean((16 * MIB, 8e-3, 0.0, slack + 1))
    assert not calibration.read_sample_clean((16 * MIB, 8e-3, 1e-3, 0))


def test_foreign_io_counts_what_the_device_moved_besides_the_read():
    own = 4 * MIB + 4096
    assert calibration.foreign_io_bytes((100, 200), (100 + own, 200), own) == 0
    assert calibration.foreign_io_bytes((100, 200), (100 + own + 8192, 200 + 64 * MIB), own) == 8192 + 64 * MIB
    assert calibration.foreign_io_bytes(None, (1, 2), own) == 0  # no device to watch (tmpfs)


def test_device_stat_sectors_are_512_bytes(tmp_path):
    # Documentation/block/stat.rst: read I/Os, merges, sectors, ticks; write I/Os, merges, sectors, ...
    stat = tmp_path / "stat"
    stat.write_text("    1507      12    98304     840   2040     310   131072    3300        0     2600     4140\n")
    assert calibration._device_bytes(str(stat)) == (98304 * 512, 131072 * 512)
    assert calibration._device_bytes(None) is None


def test_runqueue_wait_is_seconds_and_never_goes_back():
    first = calibration.runqueue_wait_s()
    if first is None:
        pytest.skip("the kernel gives no per-thread scheduler statistics")
    sum(range(100_000))
    second = calibration.runqueue_wait_s()
    assert second is not None and 0.0 <= first <= second
    assert calibration._wait_delta(first, second) == second - first
    assert calibration._wait_delta(second, first) == 0.0  # a thread that ended takes its count along
    assert calibration._wait_delta(None, second) == 0.0
