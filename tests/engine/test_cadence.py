"""Adaptive checkpoint cadence: the estimate (history, warnings, telemetry trends), the window log
that survives SIGKILL, and the engine still bitwise when records land at irregular points."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from testkit import HANG_S, MAX_NEW, CutAfter, engine, inputs_for

from common.errors import CliError
from flight.checkpoint.cadence import P_MIN, VISION_RATE_KEY, Cadence, WindowLog, WriteCosts
from flight.checkpoint.policies import POLICIES, Geometry
from flight.cli_options import EXIT_USAGE, add_engine_arguments, cadence_for, engine_options
from flight.engine import Engine, EngineOptions, SimulatedCut
from flight.model.loader import load_model
from flight.options import default_cadence, resolve_cadence


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_fixed_cadence_never_writes_early():
    clock = Clock()
    cadence = Cadence("fixed", [1.0, 1.0, 1.0, 1.0], clock=clock)
    cadence.observe_unit("decode", 0.5)
    cadence.warning(0.0)
    assert not cadence.early_record("decode", 1, 16)


def test_history_gives_the_chance_of_a_cut_given_the_time_already_up():
    clock = Clock()
    cadence = Cadence("adaptive", [2.0, 3.0, 4.0, 10.0, 11.0, 12.0, 13.0, 14.0], clock=clock)
    cadence.observe_unit("decode", 0.5)
    cadence.observe_write("decode", 0.01)
    # up 1.5 s: within the next 1.5 s, 2 of the 8 windows seen would end
    clock.t = 1.5
    assert cadence.cut_probability(1.5) == pytest.approx(2 / 8)
    # up 5 s: only the five long windows are left, none ends within 4 s
    clock.t = 5.0
    assert cadence.cut_probability(4.0) == 0.0
    assert not cadence.early_record("decode", 2, 10)  # horizon 4 s: no record before its time
    # up 11.5 s: two of the three windows still alive end within 1.5 s
    clock.t = 11.5
    assert cadence.cut_probability(1.5) == pytest.approx(2 / 3)
    assert cadence.early_record("decode", 2, 5)
    assert not cadence.early_record("decode", 0, 5)  # nothing new since the last record
    assert not cadence.early_record("decode", 5, 5)  # the fixed cadence writes this one
    # outlived (nearly) every window: memoryless from the mean
    clock.t = 13.5
    assert 0 < cadence.cut_probability(1.0) < 1


def test_an_early_record_must_be_worth_its_write():
    clock = Clock()
    cadence = Cadence("adaptive", [1.0] * 5, clock=clock)
    cadence.observe_unit("vision", 0.1)
    cadence.observe_write("vision", 5.0)  # a vision state takes far longer to write than the work it saves
    clock.t = 0.8
    assert cadence.cut_probability(0.3) >= P_MIN  # the next vision state, 3 blocks of 0.1 s away
    assert not cadence.early_record("vision", 1, 4)
    cadence.observe_unit("decode", 0.1)
    assert not cadence.early_record("decode", 1, 4)  # no decode record timed yet: its cost is unknown
    cadence.observe_write("decode", 0.01)
    assert cadence.early_record("decode", 1, 4)  # decode records are cheap


def test_an_early_record_must_end_before_the_next_scheduled_one():
    """Worth its write (p x work at risk above it), but the write would still run when the
    fixed cadence's next record is due, which would then wait behind it: no early record."""
    clock = Clock()
    cadence = Cadence("adaptive", [1.0] * 5, clock=clock, write_s={"vision": 0.25})  # from state/write-costs
    cadence.observe_unit("vision", 0.1)
    clock.t = 0.95
    assert cadence.cut_probability(0.2) == 1.0
    assert cadence.early_record("vision", 5, 8)  # 0.5 s at risk, written in 0.25 s, the next due in 0.3 s
    assert not cadence.early_record("vision", 6, 8)  # 0.6 s at risk, but the next is due in 0.2 s
    fresh = Cadence("adaptive", [1.0] * 5, clock=clock)
    fresh.observe_unit("vision", 0.1)
    assert not fresh.early_record("vision", 5, 8)  # no vision state timed since launch: cost unknown


def test_a_vision_state_whose_write_outlasts_the_phase_and_the_work_it_saves_is_skipped():
    """Cadence.skip_vision_state (docs/engine.md, "Cadence"): the campaign's numbers in
    miniature, one block a second and a state of 3 MB at 6 us per byte (18 s to write)."""
    clock = Clock()
    assert not Cadence("fixed", clock=clock).skip_vision_state(4, 2, 3_000_000, 1_500_000, 4.0, 1_500_000)
    cadence = Cadence("adaptive", clock=clock)
    cadence.observe_unit("vision", 1.0)
    assert not cadence.skip_vision_state(4, 2, 3_000_000)  # no write measured: the fixed cadence's state
    cadence.observe_write("vision", 9.0, 1_500_000)  # 6 us per byte
    assert cadence.skip_vision_state(4, 2, 3_000_000)  # 18 s: past the phase (2 s) and the work (4 s)
    assert cadence.vision_states_skipped == 1
    assert not cadence.skip_vision_state(4, 20, 3_000_000)  # written before the phase ends
    assert not cadence.skip_vision_state(20, 2, 3_000_000)  # written before its 20 blocks could be redone
    # a backlog: 1 MB still to write before it (1.5 MB under way for 3 s) ends it past 20 blocks
    assert cadence.skip_vision_state(4, 20, 2_000_000, 2_500_000, 3.0, 1_500_000)
    assert not cadence.skip_vision_state(4, 20, 2_000_000)

    # unmeasured, but the record being written has taken 4 s for 1.5 MB so far: at least that slow
    slow = Cadence("adaptive", clock=clock)
    slow.observe_unit("vision", 1.0)
    assert slow.skip_vision_state(4, 2, 3_000_000, 1_500_000, 4.0, 1_500_000)  # >= 8 s
    assert not slow.skip_vision_state(4, 2, 3_000_000, 1_500_000, 0.5, 1_500_000)  # >= 1 s: fits

    # a cut likely before vision.out is durable keeps it: the windows lived through, or a warning
    for likely in (Cadence("adaptive", [20.0] * 5, clock=clock), Cadence("adaptive", [1000.0] * 5, clock=clock)):
        likely.observe_unit("vision", 1.0)
        likely.observe_write("vision", 9.0, 1_500_000)
        if likely.windows[0] > 100:
            assert likely.skip_vision_state(4, 2, 3_000_000)  # long windows: the cut is far
            likely.warning(30.0)
        assert not likely.skip_vision_state(4, 2, 3_000_000)


def test_write_costs_survive_the_process_and_a_damaged_file_is_ignored(tmp_path):
    state = tmp_path / "state"
    costs = WriteCosts(str(state))
    assert costs.load() == {}  # first boot
    costs.save({"decode": 0.02})
    costs.save({"decode": 0.02, "vision": 1.5, "prefill": 9.0})  # only the phases with early records
    costs.close()
    raw = (state / "write-costs").read_bytes()
    assert len(raw) == 28
    again = WriteCosts(str(state))
    assert again.load() == {"vision": 1.5, "decode": 0.02} and not again.damaged
    cadence = Cadence("adaptive", [1.0] * 5)
    cadence.observe_write("decode", 0.04)  # this process's own measurement goes on from its own
    cadence.learn_writes(again.load())
    assert cadence.learned_writes() == {"vision": 1.5, "decode": 0.04}
    for damaged in (raw[:27], raw[:20], raw + b"x", bytes([raw[0] ^ 1]) + raw[1:]):
        (state / "write-costs").write_bytes(damaged)
        broken = WriteCosts(str(state))
        assert broken.load() == {} and broken.damaged
        broken.save({"vision": 2.0})  # rewritten at the next measurement
        assert WriteCosts(str(state)).load() == {"vision": 2.0}
        broken.close()


def test_a_record_written_before_the_rate_was_kept_still_reads(tmp_path):
    """The 20-byte state/write-costs (two times and their CRC32C, docs/engine.md) reads without a
    rate, and the next save writes the 28-byte layout over it."""
    import struct

    import crc32c

    state = tmp_path / "state"
    state.mkdir()
    head = struct.pack("<dd", 1.5, float("nan"))
    (state / "write-costs").write_bytes(head + struct.pack("<I", crc32c.crc32c(head)))
    old = WriteCosts(str(state))
    assert old.load() == {"vision": 1.5} and not old.damaged
    old.save({"vision": 1.5, "decode": 0.02, VISION_RATE_KEY: 4.0})
    old.close()
    assert len((state / "write-costs").read_bytes()) == 28
    assert WriteCosts(str(state)).load() == {"vision": 1.5, "decode": 0.02, VISION_RATE_KEY: 4.0}


def test_the_vision_write_rate_survives_a_reboot_and_a_burst_does_not_flip_the_rule(tmp_path):
    """The vision states' write rate is the median of the last RATE_WINDOW writes, kept in
    state/write-costs; a boot starts from it as PRIOR_WRITES of them (docs/engine.md, "Cadence").
    One vision block a second, a 3 MB state at 3 us per byte (9 s) with 4 blocks since the last
    state and 8 to go: skipped (9 s > 8 s and > 4 s). A write after an idle spell that goes at
    the storage's burst speed (a hundredth of the time) would have taken a decayed mean (0.7 old
    + 0.3 new) to 2.1 us per byte, 6.3 s, and kept the state; the median keeps the rule's answer."""
    state = tmp_path / "state"
    first = Cadence("adaptive")
    first.observe_unit("vision", 1.0)
    for _ in range(3):
        first.observe_write("vision", 4.5, 1_500_000)  # 3 us per byte, sustained
    assert first.skip_vision_state(4, 8, 3_000_000)
    costs = WriteCosts(str(state))
    costs.save(first.learned_writes())
    costs.close()

    # the process is gone (a cut); the next boot reads state/write-costs before any write of its own
    learned = WriteCosts(str(state)).load()
    assert learned[VISION_RATE_KEY] == pytest.approx(3e-6 * 2**20)
    rebooted = Cadence("adaptive", write_s=learned)
    rebooted.observe_unit("vision", 1.0)
    assert rebooted.write_rate["vision"] == pytest.approx(3e-6)
    assert rebooted.skip_vision_state(4, 8, 3_000_000)  # the same answer before its first write
    rebooted.observe_write("vision", 0.045, 1_500_000)  # a burst: 0.03 us per byte
    assert rebooted.write_rate["vision"] == pytest.approx(3e-6)
    assert rebooted.skip_vision_state(4, 8, 3_000_000)  # not flipped

    # a lasting change of the storage does move it: three writes that agree outvote the kept rate
    for _ in range(2):
        rebooted.observe_write("vision", 0.045, 1_500_000)
    assert rebooted.write_rate["vision"] == pytest.approx(3e-8)
    assert not rebooted.skip_vision_state(4, 8, 3_000_000)
    # without a kept rate, a fresh payload's first write is all it knows (docs/engine.md: known limit)
    fresh = Cadence("adaptive")
    fresh.observe_unit("vision", 1.0)
    fresh.observe_write("vision", 0.045, 1_500_000)
    assert not fresh.skip_vision_state(4, 8, 3_000_000)


def test_warning_and_telemetry_trends_announce_the_cut():
    clock = Clock()
    cadence = Cadence("adaptive", clock=clock, thermal_limit_c=55.0, soc_cutoff=0.4)
    cadence.observe_unit("decode", 1.0)
    cadence.observe_write("decode", 0.01)
    assert cadence.cut_probability(10.0) == 0.0  # no history, no warning, no trend
    # temperature rising 0.5 C/s, now 52.5 C: the 55 C limit is 5 s away
    for k in range(6):
        cadence.thermal(100.0 + k, 50.0 + 0.5 * k)
    assert cadence.cut_probability(4.0) < 1.0 and cadence.cut_probability(6.0) == 1.0
    assert cadence.early_record("decode", 1, 9)  # next fixed record in 8 s, after the predicted cut
    cooling = Cadence("adaptive", clock=clock)
    for k in range(6):
        cooling.thermal(float(k), 54.0 - k)
        cooling.power(float(k), 0.9)
    assert cooling.cut_probability(100.0) == 0.0
    draining = Cadence("adaptive", clock=clock, soc_cutoff=0.4)
    for k in range(6):
        draining.power(float(k), 0.45 - 0.01 * k)  # 0.40 reached at t = 5
    assert draining.cut_probability(0.5) == 1.0
    warned = Cadence("adaptive", clock=clock)
    warned.warning(3.0)
    assert warned.cut_probability(2.0) == 0.0 and warned.cut_probability(3.0) == 1.0


def test_window_log_survives_sigkill_and_skips_damaged_entries(tmp_path):
    state = tmp_path / "state"
    program = textwrap.dedent(f"""
        import sys, time
        from flight.checkpoint.cadence import WindowLog
        log = WindowLog({str(state)!r})
        log.open(int(sys.argv[1]))
        log.mark()
        print("up", flush=True)
        time.sleep(0.3)
        log.mark()
        print("marked", flush=True)
        time.sleep(600)
    """)
    lifetimes = []  # each process's whole life, seen from here: a window cannot be longer
    for boot in (1, 2, 3):
        born = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", program, str(boot)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert proc.stdout.readline().strip() == "up"
        assert proc.stdout.readline().strip() == "marked"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        lifetimes.append(time.monotonic() - born)
    slack = 1e-3  # the clocks' rounding, not the machine's speed
    log = WindowLog(str(state))
    opened = time.monotonic()
    lengths = log.open(4)
    log.close()
    boot_4 = time.monotonic() - opened
    assert len(lengths) == 3  # each killed after its second mark, 0.3 s after its first
    assert all(0.3 <= x <= life + slack for x, life in zip(lengths, lifetimes, strict=True)), (lengths, lifetimes)
    raw = bytearray((state / "windows.log").read_bytes())
    raw[3] ^= 0xFF  # damage the first entry, tear the end
    (state / "windows.log").write_bytes(bytes(raw) + b"\x01\x02")
    again = WindowLog(str(state))
    lengths = again.open(5)
    # boots 2 and 3 kept, boot 4's (closed at once) added; the damaged entry and the torn tail skipped
    assert len(lengths) == 3 and lengths[-1] <= boot_4 + slack and again.bytes_dropped == 16 + 2
    again.close()


# ---- the engine with an adaptive cadence, stopped everywhere it matters -------------------------------

GEOMETRY = Geometry(chunk=16, group=2, decode_every=4, vision_every=2)


class UnitClock(Cadence):
    """An adaptive cadence whose clock advances one second per unit of work: its decisions are
    the same in every run, whatever this machine's speed."""

    def __init__(self, windows):
        self.now = Clock()
        # records that write in a hundredth of a unit, as earlier boots measured (state/write-costs)
        super().__init__("adaptive", windows, clock=self.now, write_s={"vision": 0.01, "decode": 0.01})

    def observe_unit(self, phase, seconds):
        self.now.t += 1.0
        super().observe_unit(phase, 1.0)

    def observe_write(self, phase, seconds, nbytes=None):
        pass


# Windows of the past, in units of vision and decode work (the clock below counts those): many
# end during the vision blocks (units 1-4), some early in decode (units 5 on), a few last long.
HISTORY = [2.0, 2.5, 3.0, 3.5, 4.0, 6.5, 7.0, 7.5, 40.0, 41.0, 42.0]


def _adaptive(model, events=None, after_commit=None):
    cadence = UnitClock(HISTORY)
    options = EngineOptions(geometry=GEOMETRY, async_writes=False, cadence="adaptive")
    return Engine(model, options, events=events, after_commit=after_commit, cadence=cadence), cadence


def test_adaptive_cadence_is_bitwise_under_exhaustive_stops(model_dirs, tmp_path):
    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    fixed_commits = CutAfter(10**9)
    engine(model, GEOMETRY, cadence="fixed", after_commit=fixed_commits.commit).run(
        inputs, str(tmp_path / "fixed"), MAX_NEW
    )
    units, commits, written = CutAfter(10**9), CutAfter(10**9), []

    def commit(what, nbytes):
        written.append(what)
        commits.commit(what, nbytes)

    announced = []

    def unit_events(name, **fields):
        if name == "early_record":
            announced.append(fields["phase"])
        units.event(name, **fields)

    eng, cadence = _adaptive(model, events=unit_events, after_commit=commit)
    ref = eng.run(inputs, str(tmp_path / "ref"), MAX_NEW)
    # early records in both phases with a cadence (fixed: vision.state[2], decode every 4 steps)
    decode = [w for w in written if w.startswith("decode")]
    assert "vision.state[3]" in written and decode[0] != "decode[..4]", written
    assert cadence.early_records >= 2 and commits.seen > fixed_commits.seen
    # each one the cadence asked for is announced (the payload logs it for the simulator's check)
    assert len(announced) == cadence.early_records and set(announced) == {"vision", "decode"}
    # Stop after every vision block and decode step, and after every record that is not a
    # prefill block (prefill has no cadence to adapt: every block is persisted).
    stops = [("event", n) for n in range(1, units.seen + 1)]
    stops += [("commit", n) for n in range(1, commits.seen + 1)]
    prefill_units = set(range(5, 5 + 8))  # after the 4 vision blocks, 2 groups x 4 chunks
    phases = set()
    for hook, n in stops:
        if hook == "event" and n in prefill_units:
            continue
        cut = CutAfter(n)
        eng, _ = _adaptive(
            load_model(model_dir, device="cpu"),
            **({"events": cut.event} if hook == "event" else {"after_commit": cut.commit}),
        )
        ckpt = tmp_path / f"{hook}-{n}"
        with pytest.raises(SimulatedCut):
            eng.run(inputs, str(ckpt), MAX_NEW)
        if hook == "commit" and cut.last[0].startswith("prefill"):
            shutil.rmtree(ckpt)
            continue
        resumed, _ = _adaptive(load_model(model_dir, device="cpu"))
        result = resumed.run(inputs, str(ckpt), MAX_NEW)
        assert result.token_ids == ref.token_ids, (hook, n, cut.last)
        assert torch.equal(result.logits, ref.logits), (hook, n, cut.last)
        phases.add(result.resumed_from["phase"])
        shutil.rmtree(ckpt)
    assert {"vision", "decode"} <= phases


def test_an_early_record_in_flight_never_displaces_a_scheduled_one(model_dirs, tmp_path):
    """The adaptive cadence writes vision.state[1] early; its write is still under way when the
    fixed cadence's vision.state[2] is due (the writer holds it until block 3 is done). The
    scheduled state is queued behind it, not dropped as a superseded optional one: adaptive
    only adds records, the fixed cadence stays the bound on their spacing."""
    import threading

    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    ref = engine(model, GEOMETRY, cadence="fixed").run(inputs, str(tmp_path / "ref"), MAX_NEW)
    block3_done, written = threading.Event(), []

    def events(name, **fields):
        if name == "vision_block_done" and fields["block"] == 3:
            block3_done.set()

    def commit(what, nbytes):
        written.append(what)
        if what == "vision.state[1]":
            assert block3_done.wait(HANG_S), "vision block 3 never came"

    # up 1 unit after block 1: 4 of the 6 windows lived through end within the next unit
    cadence = UnitClock([1.5, 1.8, 1.9, 2.0, 50.0, 50.0])
    options = EngineOptions(geometry=GEOMETRY, async_writes=True, cadence="adaptive")
    eng = Engine(model, options, events=events, after_commit=commit, cadence=cadence)
    result = eng.run(inputs, str(tmp_path / "task"), MAX_NEW)
    assert written[:2] == ["vision.state[1]", "vision.state[2]"], written
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)


class SlowVisionWrites(UnitClock):
    """No window history (no cut expected) and vision states that write, as measured, at a
    second per kilobyte: every scheduled one outlasts the phase and the work it saves."""

    def __init__(self):
        super().__init__([])
        Cadence.observe_write(self, "vision", 1.0, 1000)  # 1e-3 s per byte

    def observe_write(self, phase, seconds, nbytes=None):
        pass


def test_skipped_vision_states_stay_bitwise_under_stops(model_dirs, tmp_path):
    """The skip rule drops vision.state[2]; a stop after every vision block, and after every
    record written up to the first prefill block, resumes bitwise."""
    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    # the background writer: a synchronous one writes on the compute path and is never skipped for
    options = EngineOptions(geometry=GEOMETRY, async_writes=True, cadence="adaptive")
    skipped, written, blocks = [], [], CutAfter(10**9, names=("vision_block_done",))

    def events(name, **fields):
        blocks.event(name, **fields)
        if name == "vision_state_skipped":
            skipped.append(fields["block"])

    def commit(what, nbytes):
        written.append(what)

    ref = Engine(model, options, events=events, after_commit=commit, cadence=SlowVisionWrites()).run(
        inputs, str(tmp_path / "ref"), MAX_NEW
    )
    assert skipped == [2] and not any(w.startswith("vision.state") for w in written), (skipped, written)
    first_prefill = next(i for i, w in enumerate(written) if w.startswith("prefill"))
    stops = [("event", n) for n in range(1, blocks.seen + 2)] + [("commit", n) for n in range(1, first_prefill + 2)]
    for hook, n in stops:
        cut = CutAfter(n)
        hooks = {"events": cut.event} if hook == "event" else {"after_commit": cut.commit}
        ckpt = tmp_path / f"{hook}-{n}"
        with pytest.raises(SimulatedCut):
            Engine(load_model(model_dir, device="cpu"), options, cadence=SlowVisionWrites(), **hooks).run(
                inputs, str(ckpt), MAX_NEW
            )
        resumed = Engine(load_model(model_dir, device="cpu"), options, cadence=SlowVisionWrites()).run(
            inputs, str(ckpt), MAX_NEW
        )
        assert resumed.token_ids == ref.token_ids, (hook, n, cut.last)
        assert torch.equal(resumed.logits, ref.logits), (hook, n, cut.last)
        shutil.rmtree(ckpt)


def test_adaptive_prefill_block_fits_the_windows_lived_through():
    assert Cadence("fixed", [0.1] * 5).prefill_group(4, 1.0) == 4  # the paper's G, whatever the windows
    assert Cadence("adaptive", [0.1, 0.1]).prefill_group(4, 1.0) == 4  # too little history to judge
    assert Cadence("adaptive", [0.1] * 5).prefill_group(4, 1.0) == 1  # never below one layer
    # median window 12 s: a quarter of it holds three 1-second layers, not the configured four
    assert Cadence("adaptive", [10.0, 12.0, 14.0]).prefill_group(4, 1.0) == 3
    assert Cadence("adaptive", [100.0] * 5).prefill_group(4, 1.0) == 4  # never above the configured G
    # the engine asks before it looks a cost estimate up: only when a shape can be chosen
    assert not Cadence("fixed", [0.1] * 5).shapes_blocks(4)
    assert not Cadence("adaptive", [0.1, 0.1]).shapes_blocks(4)
    assert not Cadence("adaptive", [0.1] * 5).shapes_blocks(1)
    assert Cadence("adaptive", [0.1] * 3).shapes_blocks(4)


def test_adaptive_block_shape_is_kept_by_the_task_and_bitwise(model_dirs, tmp_path):
    """Short windows make the adaptive cadence run a new task's prefill one layer per block; the
    MANIFEST keeps that shape, so a resume after a cut reads it back even when the windows seen
    since then would choose otherwise, and the answer is the uninterrupted one."""
    from flight.checkpoint.store import CheckpointStore

    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    ref = engine(model, GEOMETRY, cadence="fixed").run(inputs, str(tmp_path / "ref"), MAX_NEW)  # G = 2

    def adaptive(windows, **hooks):
        options = EngineOptions(geometry=GEOMETRY, async_writes=False, cadence="adaptive")
        return Engine(load_model(model_dir, device="cpu"), options, cadence=Cadence("adaptive", windows), **hooks)

    short, long = [1e-6] * 5, [1e6] * 5  # windows far shorter / longer than any layer on one chunk
    ckpt = tmp_path / "task"
    cut = CutAfter(3, names=("prefill_block_done",))
    with pytest.raises(SimulatedCut):
        adaptive(short, events=cut.event).run(inputs, str(ckpt), MAX_NEW)
    assert CheckpointStore(str(ckpt)).stored_manifest()["group"] == 1
    opened = []
    resumed = adaptive(long, events=lambda name, **f: opened.append(f) if name == "request_opened" else None)
    result = resumed.run(inputs, str(ckpt), MAX_NEW)
    assert opened[0]["status"] == "resume" and opened[0]["groups"] == model.adapter.num_layers, opened
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)
    # a new task under long windows keeps the configured G
    adaptive(long).run(inputs, str(tmp_path / "other"), MAX_NEW)
    assert CheckpointStore(str(tmp_path / "other")).stored_manifest()["group"] == GEOMETRY.group


def test_payload_feeds_bus_telemetry_and_warnings_to_its_cadence(tmp_path):
    from common.wire import Apid, NodeId, PowerCause, encode
    from common.wire import messages as msgs
    from flight.engine import EngineOptions
    from flight.runtime.app import FlightApp, FlightConfig

    app = FlightApp(
        FlightConfig(
            str(tmp_path / "data"),
            "unused-model",
            str(tmp_path / "keys"),
            "tcp://127.0.0.1:1",
            EngineOptions(cadence="adaptive"),
        )
    )
    seq = iter(range(100))
    for k in range(4):
        app.handle_packet(
            encode(
                msgs.ThermalReport(trace_time_s=float(k), payload_temp_c=50.0 + k, bus_temp_c=20.0),
                Apid.BUS,
                next(seq),
                source_id=NodeId.BUS,
            )
        )
        app.handle_packet(
            encode(
                msgs.PowerReport(
                    trace_time_s=float(k), payload_on=True, bus_voltage_v=15.0, payload_power_w=15.0, battery_soc=0.9
                ),
                Apid.BUS,
                next(seq),
                source_id=NodeId.BUS,
            )
        )
    assert len(app.cadence.temperature.samples) == 4 and len(app.cadence.battery.samples) == 4
    assert app.cadence.cut_probability(5.0) == 1.0  # 1 C/s from 53 C: the 55 C limit in 2 s
    app.handle_packet(
        encode(
            msgs.ShutdownWarning(trace_time_s=4.0, lead_time_s=2.0, cause=PowerCause.THERMAL),
            Apid.BUS,
            next(seq),
            source_id=NodeId.BUS,
        )
    )
    assert app.cadence.cut_at is not None


# ---- the default: the policy's -------------------------------------------------------------------


def test_the_default_cadence_is_the_policys():
    assert default_cadence("orbitweaver") == "adaptive"
    for policy in set(POLICIES) - {"orbitweaver"}:  # the baselines and none: their definitions' cadence
        assert default_cadence(policy) == "fixed", policy
    assert EngineOptions().cadence is None  # resolved where the policy that runs is known
    assert resolve_cadence("orbitweaver", None) == "adaptive" and resolve_cadence("hcache", None) == "fixed"
    assert resolve_cadence("orbitweaver", "fixed") == "fixed"  # the paper's cadence, asked for


def _engine_args(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_command_line_takes_the_policys_cadence_unless_told():
    for argv, cadence in (
        ((), "adaptive"),
        (("--cadence", "fixed"), "fixed"),
        (("--cadence", "adaptive"), "adaptive"),
        (("--policy", "sonic-layer"), "fixed"),
        (("--policy", "hcache", "--cadence", "fixed"), "fixed"),
        (("--policy", "none"), "fixed"),
    ):
        args = _engine_args(*argv)
        assert engine_options(args).cadence == cadence, argv
        assert cadence_for(args).mode == cadence, argv  # the onboard process's own, the same
    for baseline in ("sonic-layer", "sonic-chunk", "hcache", "hcache+"):
        with pytest.raises(CliError) as refused:
            engine_options(_engine_args("--policy", baseline, "--cadence", "adaptive"))
        assert refused.value.code == EXIT_USAGE and "orbitweaver's" in str(refused.value)


def test_engine_options_refuse_a_cadence_the_policy_cannot_fly():
    # Not only the command lines: an options object built in code is refused too, where the
    # engine used to fly a baseline's fixed cadence and say nothing.
    for baseline in ("sonic-layer", "sonic-chunk", "hcache", "sonic-layer+", "none"):
        with pytest.raises(ValueError, match="orbitweaver's"):
            EngineOptions(policy=baseline, cadence="adaptive")
        assert EngineOptions(policy=baseline, cadence="fixed").cadence == "fixed"
    with pytest.raises(ValueError, match="unknown cadence"):
        EngineOptions(cadence="sometimes")
    assert EngineOptions(cadence="adaptive").cadence == "adaptive"


def test_the_onboard_process_takes_the_policys_cadence(tmp_path):
    from flight.runtime.app import FlightApp, FlightConfig

    def app(options, name):
        return FlightApp(
            FlightConfig(str(tmp_path / name), "unused-model", str(tmp_path / "keys"), "tcp://127.0.0.1:1", options)
        )

    assert app(EngineOptions(), "default").cadence.mode == "adaptive"
    assert app(None, "none-given").cadence.mode == "adaptive"  # the engine's own default options
    assert app(EngineOptions(policy="sonic-chunk"), "baseline").cadence.mode == "fixed"
    assert app(EngineOptions(cadence="fixed"), "paper").cadence.mode == "fixed"


def test_a_default_orbitweaver_engine_adapts_and_gives_the_fixed_cadences_bits(model_dirs, tmp_path):
    """An engine whose options name no cadence runs orbitweaver's default, the adaptive one: with
    nothing to go on it writes what the fixed cadence writes; with short windows lived through it
    runs a new task one layer per block, and a cut and a resume still give the fixed cadence's
    answer bit for bit."""
    from flight.checkpoint.store import CheckpointStore

    model_dir = model_dirs["qwen3-vl"]
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    fixed_commits = []
    fixed = engine(model, GEOMETRY, cadence="fixed", after_commit=lambda what, n: fixed_commits.append(what))
    assert fixed.cadence.mode == "fixed" and not fixed.adaptive
    ref = fixed.run(inputs, str(tmp_path / "fixed"), MAX_NEW)

    default_commits = []
    default = engine(model, GEOMETRY, after_commit=lambda what, n: default_commits.append(what))
    assert default.cadence.mode == "adaptive" and default.adaptive
    plain = default.run(inputs, str(tmp_path / "default"), MAX_NEW)
    assert plain.token_ids == ref.token_ids and torch.equal(plain.logits, ref.logits)
    assert default_commits == fixed_commits  # no history, no warning, no trend: nothing early
    assert engine(model, GEOMETRY, policy="hcache").cadence.mode == "fixed"  # a baseline's default

    short = [1e-6] * 5  # windows far shorter than any layer on one chunk
    ckpt = tmp_path / "cut"
    cut = CutAfter(3, names=("prefill_block_done",))
    first = engine(load_model(model_dir, device="cpu"), GEOMETRY, events=cut.event)
    first.cadence.set_windows(short)
    with pytest.raises(SimulatedCut):
        first.run(inputs, str(ckpt), MAX_NEW)
    assert CheckpointStore(str(ckpt)).stored_manifest()["group"] == 1  # the default adapted G
    resumed = engine(load_model(model_dir, device="cpu"), GEOMETRY)
    resumed.cadence.set_windows(short)
    result = resumed.run(inputs, str(ckpt), MAX_NEW)
    assert result.resumed_from["phase"] == "prefill"
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)
