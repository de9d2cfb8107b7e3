"""Damaged storage never yields a wrong answer: a damaged record is rejected, resume falls back to
the previous good state, and the output is still bitwise identical to the uninterrupted run."""

import os
import shutil

import numpy as np
import pytest
import torch
from crashfs import CrashFS
from testkit import MAX_NEW, CutAfter, engine, inputs_for, run_to_completion

from common.record import RecordError, decode
from flight.engine import SimulatedCut
from flight.model.loader import load_model

ARCH = "qwen3-vl"


@pytest.fixture(scope="module")
def reference_run(model_dirs, tmp_path_factory):
    model = load_model(model_dirs[ARCH], device="cpu")
    inputs = inputs_for(model)
    commits = CutAfter(10**9)
    result = engine(model, after_commit=commits.commit).run(inputs, str(tmp_path_factory.mktemp("ref") / "ck"), MAX_NEW)
    return inputs, result, commits.seen


def _state_after(model_dirs, inputs, ckpt, n_commits):
    """Leave `ckpt` as a cut after the n-th commit left it; return the name of the newest record."""
    cut = CutAfter(n_commits)
    with pytest.raises(SimulatedCut):
        engine(load_model(model_dirs[ARCH], device="cpu"), after_commit=cut.commit).run(inputs, str(ckpt), MAX_NEW)
    return cut.last[0]


def _newest_file(ckpt, what: str) -> str:
    if what.startswith("decode"):
        return os.path.join(ckpt, "decode.log")
    if what.startswith("prefill"):
        files = [os.path.join(ckpt, "prefill", f) for f in os.listdir(os.path.join(ckpt, "prefill"))]
        return max(files, key=os.path.getmtime)
    if what == "vision.out":
        return os.path.join(ckpt, "vision.out")
    files = [os.path.join(ckpt, f) for f in ("vision.A", "vision.B") if os.path.exists(os.path.join(ckpt, f))]
    return max(files, key=os.path.getmtime)


def _assert_same(result, ref):
    assert result.token_ids == ref.token_ids
    assert torch.equal(result.logits, ref.logits)


# Commit numbers that leave a vision state, the vision output, a prefill block and a decode record newest.
def _commit_points(total):
    return {"vision": 2, "vision.out": 4, "prefill": 8, "decode": total - 1}


def _damage(path, how, rng, decode_log=False):
    data = bytearray(open(path, "rb").read())
    start = 0
    if decode_log:  # damage the newest (last) record of the log
        pos = 0
        while pos < len(data):
            _, n = decode(data, pos)
            start, pos = pos, pos + n
    rec = data[start:]
    if how == "header":
        rec[int(rng.integers(0, 24))] ^= 1 << int(rng.integers(0, 8))
    elif how == "payload":
        rec[int(rng.integers(len(rec) // 2, len(rec) - 16))] ^= 1 << int(rng.integers(0, 8))
    elif how == "footer":
        rec[len(rec) - 1 - int(rng.integers(0, 16))] ^= 1 << int(rng.integers(0, 8))
    elif how == "zeros":
        a = int(rng.integers(0, len(rec) - 64))
        rec[a : a + 64] = bytes(64)
    data[start:] = rec
    if how == "missing":
        os.unlink(path)
        return
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("newest", ["vision", "vision.out", "prefill", "decode"])
@pytest.mark.parametrize("how", ["header", "payload", "footer", "zeros", "missing"])
def test_damaged_newest_record_falls_back(model_dirs, reference_run, tmp_path, newest, how):
    inputs, ref, total = reference_run
    ckpt = str(tmp_path / "ck")
    what = _state_after(model_dirs, inputs, ckpt, _commit_points(total)[newest])
    path = _newest_file(ckpt, what)
    _damage(path, how, np.random.default_rng(hash((newest, how)) % 2**32), decode_log=newest == "decode")
    _assert_same(run_to_completion(model_dirs[ARCH], inputs, ckpt), ref)


@pytest.mark.parametrize("newest", ["vision", "prefill", "decode"])
def test_truncated_newest_record_falls_back(model_dirs, reference_run, tmp_path, newest):
    """Every truncation is rejected by the reader (checked at every byte offset below); here a spread
    of offsets goes through a full resume."""
    inputs, ref, total = reference_run
    base = str(tmp_path / "base")
    what = _state_after(model_dirs, inputs, base, _commit_points(total)[newest])
    path = _newest_file(base, what)
    size = os.path.getsize(path)
    last_start = 0
    if newest == "decode":
        buf, pos = bytearray(open(path, "rb").read()), 0
        while pos < len(buf):
            _, n = decode(buf, pos)
            last_start, pos = pos, pos + n
    rng = np.random.default_rng(7)
    offsets = sorted(
        {
            last_start,
            last_start + 1,
            last_start + 23,
            last_start + 24,
            last_start + 64,
            size - 17,
            size - 16,
            size - 1,
            *rng.integers(last_start, size, 4).tolist(),
        }
    )
    for off in offsets:
        ckpt = str(tmp_path / f"t{off}")
        shutil.copytree(base, ckpt)
        with open(os.path.join(ckpt, os.path.relpath(path, base)), "r+b") as f:
            f.truncate(off)
        _assert_same(run_to_completion(model_dirs[ARCH], inputs, ckpt), ref)
        shutil.rmtree(ckpt)


def test_every_truncation_of_a_record_is_rejected(model_dirs, reference_run, tmp_path):
    inputs, ref, total = reference_run
    ckpt = str(tmp_path / "ck")
    _state_after(model_dirs, inputs, ckpt, _commit_points(total)["decode"])
    for name in ("decode.log", "vision.out", "MANIFEST"):
        data = open(os.path.join(ckpt, name), "rb").read()
        full, n = decode(bytearray(data), 0)
        for cut in range(n):
            with pytest.raises(RecordError):
                decode(bytearray(data[:cut]), 0)


def test_stale_records_of_another_request_are_ignored(model_dirs, reference_run, tmp_path):
    """Records left by an earlier request (another salt) in the directory are never used."""
    inputs, ref, total = reference_run
    ckpt = str(tmp_path / "ck")
    _state_after(model_dirs, inputs, ckpt, _commit_points(total)["decode"])
    stale = {n: open(os.path.join(ckpt, "prefill", n), "rb").read() for n in os.listdir(os.path.join(ckpt, "prefill"))}
    os.unlink(os.path.join(ckpt, "MANIFEST"))  # the directory now looks like a different request
    model = load_model(model_dirs[ARCH], device="cpu")
    cut = CutAfter(3)
    with pytest.raises(SimulatedCut):
        engine(model, after_commit=cut.commit).run(inputs, ckpt, MAX_NEW)
    for name, data in stale.items():  # put the old request's blocks back beside the new ones
        p = os.path.join(ckpt, "prefill", name)
        if not os.path.exists(p):
            open(p, "wb").write(data)
    result = run_to_completion(model_dirs[ARCH], inputs, ckpt)
    _assert_same(result, ref)
    assert result.resumed_from["phase"] in ("vision", "prefill")


def test_simulated_crashes_never_yield_an_accepted_wrong_state(model_dirs, reference_run, tmp_path):
    """SQLite-style crash test: cut the power at random file-system steps; whatever un-synced data
    the disk drops, tears or zeroes, the resumed result is bitwise the reference."""
    inputs, ref, _ = reference_run
    rng = np.random.default_rng(2024)
    probe = CrashFS(str(tmp_path / "probe"))
    engine(load_model(model_dirs[ARCH], device="cpu"), fs=probe).run(inputs, str(tmp_path / "probe"), MAX_NEW)
    steps = probe.steps
    assert steps > 40
    for trial in range(24):
        ckpt = str(tmp_path / f"c{trial}")
        fs = CrashFS(ckpt, cut_at_step=int(rng.integers(1, steps)))
        with pytest.raises(SimulatedCut):
            engine(load_model(model_dirs[ARCH], device="cpu"), fs=fs).run(inputs, ckpt, MAX_NEW)
        fs.crash(rng)
        # A second cut during the resume, on top of the first crash, half of the time.
        if trial % 2:
            fs2 = CrashFS(ckpt, cut_at_step=int(rng.integers(1, 20)))
            fs2.current = {p: fs2._new_inode(open(p, "rb").read()) for p in _files(ckpt)}
            for ino in fs2.current.values():
                fs2.inodes[ino].durable = fs2.inodes[ino].current
            fs2.durable = dict(fs2.current)
            fs2.dirs_current = {ckpt, os.path.join(ckpt, "prefill")}
            try:
                engine(load_model(model_dirs[ARCH], device="cpu"), fs=fs2).run(inputs, ckpt, MAX_NEW)
            except SimulatedCut:
                fs2.crash(rng)
        _assert_same(run_to_completion(model_dirs[ARCH], inputs, ckpt), ref)
        shutil.rmtree(ckpt)


def _files(root):
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names]
    return out
