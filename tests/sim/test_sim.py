"""The lifecycle simulator: record sizes are the engine's, sessions behave like the engine's
phases across cuts, and the real-size figures are computable (fast: no model runs)."""

import math

import pytest
from testkit import GEOMETRY, MAX_NEW, engine, inputs_for

from common.record import Kind, TensorSpec, encode, encoded_size
from flight.checkpoint.policies import Geometry
from hil.sim.lifecycle import Durable, RequestModel, trace_windows
from hil.sim.models import REAL_MODELS, Request, frames_request, spec_from_dir
from hil.sim.platform import Platform, Storage, target_platform

POLICIES = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache", "sonic-layer+", "sonic-chunk+", "hcache+")


def test_encoded_size_is_the_encoders_size():
    import torch

    tensors = {
        "k.0": torch.zeros(1, 2, 7, 32, dtype=torch.bfloat16),
        "v.0": torch.ones(1, 2, 7, 32),
        "hidden": torch.zeros(3, 5),
    }
    meta = {"group": 3, "chunk": 11, "layers": [6, 8], "tokens": [16, 23]}
    real = encode(Kind.PREFILL_BLOCK, meta, tensors, salt=(1 << 62) + 12345).nbytes
    specs = {
        "k.0": TensorSpec("bfloat16", (1, 2, 7, 32)),
        "v.0": TensorSpec("float32", (1, 2, 7, 32)),
        "hidden": TensorSpec("float32", (3, 5)),
    }
    assert encoded_size(Kind.PREFILL_BLOCK, meta, specs) == real


def _instant(pace=1.0):
    """A platform where every unit takes `pace` and storage is instant."""
    return Platform(
        "test",
        Storage(1e15, 0.0, 1e15, 0.0),
        boot_s=0.0,
        first_start_s=0.0,
        setup_s=0.0,
        vision_block_s=pace,
        vision_extra_s=0.0,
        decode_step_s=pace,
        pace_s=pace,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_simulated_records_are_the_bytes_the_engine_writes(model_dirs, tmp_path, policy):
    """Uninterrupted, per record kind: the simulator's record sizes equal what the real engine
    commits for the tiny model (vision states, vision output, prefill blocks, decode records)."""
    from flight.model.loader import load_model

    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    written: dict[str, int] = {}

    def events(name, **fields):
        if name == "checkpoint_committed":
            kind = fields["record"].split("[")[0].split(".state")[0]
            written[kind] = written.get(kind, 0) + fields["bytes"]

    # the simulator's records are the fixed cadence's (docs/sim.md): compare with the engine's
    engine(model, policy=policy, cadence="fixed", events=events).run(inputs, str(tmp_path / "ck"), MAX_NEW)
    visual = int((inputs.input_ids == model.adapter.image_token_id).sum())
    request = Request(visual, inputs.num_tokens - visual, MAX_NEW, 2)
    sim = RequestModel(spec_from_dir(model_dirs["qwen3-vl"]), request, _instant(), policy, GEOMETRY, "chunk-first")
    simulated: dict[str, int] = {}
    for c in sim.uninterrupted().commits:
        kind = {"vision": "vision", "vision_out": "vision.out", "block": "prefill", "decode": "decode"}.get(c.kind)
        if kind:
            simulated[kind] = simulated.get(kind, 0) + c.nbytes
    assert simulated == written


@pytest.mark.parametrize("arch", ["qwen3-vl", "qwen2.5-vl"])
def test_simulated_task_inputs_record_is_the_bytes_the_payload_writes(model_dirs, tmp_path, arch):
    """The TASK_INPUTS and TASK_PIXELS records each task writes at its first start
    (flight/runtime/inputs.py): the simulator's sizes equal what `save_inputs` writes, keyed as the
    payload keys it."""
    from common.durable import DurableFS
    from flight.model.config import processors_hash
    from flight.model.inputs import save_inputs
    from flight.model.loader import load_model
    from flight.runtime.images import content_hash

    if arch not in model_dirs:
        pytest.skip(f"no tiny {arch} model")
    model = load_model(model_dirs[arch], device="cpu")
    inputs = inputs_for(model)
    key = {
        "task": content_hash(inputs.prompt, ["a.png", "b.png"], MAX_NEW),
        "model": model.content_hash,
        "processors": processors_hash(model_dirs[arch]),
    }
    written = save_inputs(DurableFS(), str(tmp_path / "inputs.rec"), inputs, key)
    stored = {name: (tmp_path / name).stat().st_size for name in ("inputs.rec", "pixels.rec")}
    assert written == sum(stored.values())
    visual = int((inputs.input_ids == model.adapter.image_token_id).sum())
    images = int(inputs.image_grid_thw.shape[0])
    request = Request(visual, inputs.num_tokens - visual, MAX_NEW, images, len(inputs.prompt.encode()))
    sizes = RequestModel(spec_from_dir(model_dirs[arch]), request, _instant(), "orbitweaver", GEOMETRY).sizes
    assert (sizes.task_inputs, sizes.task_pixels) == (stored["inputs.rec"], stored["pixels.rec"])


def test_a_cut_in_prefill_resumes_and_loses_at_most_the_block_in_flight():
    spec = REAL_MODELS["qwen3-vl-2b"]
    request = frames_request(8, 2048, new_tokens=8)  # prefill-heavy: restoring beats starting over
    platform = target_platform(spec, request, "orin-agx", boot_s=5.0)
    geometry = Geometry(chunk=1024, group=4, decode_every=4, vision_every=4)
    for policy in ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache", "none"):
        m = RequestModel(spec, request, platform, policy, geometry)
        fresh = m.uninterrupted()
        alone = fresh.finished_at
        # one window cut halfway through prefill, then an open window
        cut = 5.0 + fresh.phase_s["vision"] + fresh.phase_s["prefill"] / 2
        outcome = m.run([(0.0, cut), (cut + 10.0, math.inf)], arrival=0.0)
        assert outcome.completed and outcome.cuts == 1 and outcome.sessions == 2
        second = outcome.finished_at - (cut + 10.0)
        if policy == "none":
            # boot + everything again, but the task's inputs: read back (the vision phase starts
            # from the patches, so the pixels too) instead of built and written
            st = platform.storage
            stored = (m.sizes.task_inputs, m.sizes.task_pixels)
            write = sum(st.write_latency_s + n / st.write_bytes_per_s for n in stored)
            read = sum(m._read_s(n) for n in stored)
            assert second == pytest.approx(5.0 + alone - write + read, rel=1e-6)
        else:
            assert second < 5.0 + alone  # progress survived the cut
    # uninterrupted, the baselines that commit on the compute path are slower, the others not
    times = {p: RequestModel(spec, request, platform, p, geometry).uninterrupted().finished_at for p in POLICIES}
    none = RequestModel(spec, request, platform, "none", geometry).uninterrupted().finished_at
    assert times["sonic-layer"] > none and times["sonic-chunk"] > none
    assert times["orbitweaver"] == pytest.approx(none, rel=0.02)


def test_durable_state_keeps_only_commits_before_the_cut():
    spec = REAL_MODELS["qwen3-vl-2b"]
    request = frames_request(1, 1024, new_tokens=4)
    m = RequestModel(
        spec,
        request,
        target_platform(spec, request),
        "sonic-layer",
        Geometry(chunk=512, group=4, decode_every=4, vision_every=4),
    )
    res = m.uninterrupted()
    blocks = sorted((c.t, c.key) for c in res.commits if c.kind == "block")
    cut = blocks[5][0] + 1e-9
    d = res.durable_at(Durable(), cut)
    assert set(d.blocks) == {k for _, k in blocks[:6]} and d.vision_done and not d.done


def test_trace_windows_and_warnings():
    import traces

    windows, warns = trace_windows(traces.load("trace-b"))
    assert windows and all(a < b for a, b in windows)
    assert all(windows[i][1] <= windows[i + 1][0] for i in range(len(windows) - 1))
    assert warns and all(w < end for end, w in warns.items())


# ---- the adaptive cadence: the real Cadence, asked what the engine asks ---------------------------
def _paced(pace_ms: float = 1000.0):
    """The testbench's platform at `pace_ms` per unit, storage unthrottled; the payload process
    starts 1 s after power-up and takes up a task 2 s after it."""
    from hil.sim.platform import testbench_platform

    platform = testbench_platform(
        pace_ms,
        read_mbps=None,
        write_mbps=None,
        boot_s=2.0,
        first_start_s=0.0,
        setup_s=0.0,
        commit_latency_s=1e-3,
    )
    platform.process_start_s = 1.0
    return platform


def _lived(lengths, gap: float = 10.0):
    """Power windows whose process uptimes at the cut are `lengths`, then an open window: (the
    windows, the open window's start)."""
    windows, t = [], 0.0
    for length in lengths:
        windows.append((t, t + 1.0 + length))
        t += 1.0 + length + gap
    return windows + [(t, math.inf)], t


def test_adaptive_block_shape_is_the_real_engines_for_the_same_history(model_dirs, tmp_path):
    """A new task's G: the simulator's payload, having lived through windows of these lengths,
    picks the group the real engine picks (Engine.task_geometry with a Cadence holding the same
    window history, at the same pace)."""
    from common.durable import DurableFS
    from flight.checkpoint.cadence import Cadence
    from flight.checkpoint.store import CheckpointStore
    from flight.engine import Engine
    from flight.model.loader import load_model
    from flight.options import EngineOptions
    from hil.sim.lifecycle import Payload

    model = load_model(model_dirs["qwen3-vl"], device="cpu")
    inputs = inputs_for(model)
    visual = int((inputs.input_ids == model.adapter.image_token_id).sum())
    request = Request(visual, inputs.num_tokens - visual, MAX_NEW, 2)
    spec = spec_from_dir(model_dirs["qwen3-vl"])
    configured = Geometry(chunk=16, group=4, decode_every=8, vision_every=2)
    picked = []
    for i, lengths in enumerate(([9.0, 10.0, 11.0], [3.0, 4.0, 5.0], [20.0, 35.0, 50.0, 60.0], [5.0, 5.0], [])):
        options = EngineOptions(geometry=configured, policy="orbitweaver", cadence="adaptive", pace_ms=1000.0)
        engine = Engine(model, options, cadence=Cadence("adaptive", list(lengths)))
        real = engine.task_geometry(CheckpointStore(str(tmp_path / f"ck{i}"), DurableFS()), inputs).group
        platform = _paced(1000.0)
        windows, start = _lived(lengths)
        sim = RequestModel(spec, request, platform, "orbitweaver", configured, "chunk-first")
        outcome = sim.run(windows, start, payload=Payload(platform, windows, {}, "adaptive"))
        assert outcome.group == real, lengths
        picked.append(real)
    assert picked[0] < configured.group and picked[1] == 1  # short windows: smaller blocks
    assert picked[2:] == [configured.group] * 3  # long windows, or too little history: G as configured


def _decode_records(lengths, cadence: str, warnings=None, policy="orbitweaver", cut=62.0):
    spec = spec_from_dir_tiny()
    request = Request(512, 40, 24, 2)
    geometry = Geometry(chunk=64, group=4, decode_every=8, vision_every=4)
    platform = _paced()
    windows, start = _lived(lengths)
    end = start + cut if warnings else math.inf
    windows[-1] = (start, end)
    from hil.sim.lifecycle import Payload

    payload = Payload(platform, windows, {end: start + warnings} if warnings else {}, cadence)
    model = RequestModel(spec, request, platform, policy, geometry, "chunk-first")
    res = model.session(Durable(), start + 2.0, payload.process(start, end), start + warnings if warnings else None)
    return [c.value for c in res.commits if c.kind == "decode"], len(res.early_at)


def spec_from_dir_tiny():
    """The tiny model's dimensions (4 layers, 4 vision blocks), without building it."""
    from flight.recovery.cost import ModelDims
    from hil.sim.models import ModelSpec, VisionDims

    return ModelSpec("tiny", ModelDims("tiny", 4, 128, 4, 2, 32, 256, 1000, 4), VisionDims(4, 64, 128, 16, 2, (1, 2)))


def test_adaptive_cadence_writes_early_decode_records_when_a_cut_is_likely():
    """Decode runs from about 42 s to 65 s of uptime. Windows lived through that end around
    then make a cut likely before the next fixed record (every 8 steps): the real Cadence adds
    decode records; long windows, too little history or the fixed cadence add none."""
    fixed, _ = _decode_records([45.0, 52.0, 58.0, 63.0, 66.0, 120.0], "fixed")
    assert fixed == [8, 16]  # the policy's cadence: every D = 8 steps (the last step is RESULT's)
    adaptive, early = _decode_records([45.0, 52.0, 58.0, 63.0, 66.0, 120.0], "adaptive")
    assert set(fixed) < set(adaptive) and early == len(adaptive) - len(fixed) > 0
    assert all(step > 16 for step in set(adaptive) - set(fixed))  # from where cuts are likely
    assert _decode_records([500.0, 600.0, 700.0], "adaptive") == (fixed, 0)
    assert _decode_records([45.0, 52.0], "adaptive") == (fixed, 0)
    # the baselines keep their cadence (the engine adapts only OrbitWeaver's)
    sonic_fixed = _decode_records([45.0, 52.0, 58.0, 63.0, 66.0, 120.0], "fixed", policy="sonic-layer")
    assert _decode_records([45.0, 52.0, 58.0, 63.0, 66.0, 120.0], "adaptive", policy="sonic-layer") == sonic_fixed


def test_a_warning_makes_the_adaptive_cadence_write_until_the_cut():
    """A shutdown warning 47 s into the window, the cut 62 s in (decode runs from about 44 s
    to 67 s; the windows lived through are long): the fixed cadence writes one record at the
    next boundary (checkpoint_soon); the adaptive one, told when the cut comes, writes at every
    boundary from which the next fixed record would come after the cut."""
    fixed, _ = _decode_records([500.0, 600.0, 700.0], "fixed", warnings=47.0)
    adaptive, early = _decode_records([500.0, 600.0, 700.0], "adaptive", warnings=47.0)
    assert fixed == [5, 13, 21]  # the warned record at step 5, then every D = 8 steps from it
    # from step 14 (about 57 s) the cut comes before the next fixed record would: a record at
    # every boundary, each one early (the fixed cadence's next one, 8 after the last, never comes)
    assert adaptive == [5, 13] + list(range(14, 23)) and early == 9
    assert _decode_records([500.0, 600.0, 700.0], "fixed") == ([8, 16], 0)  # unwarned


def test_an_early_vision_state_in_flight_never_displaces_the_scheduled_one():
    """As in the engine: windows lived through that end about a unit after vision block 1 make
    the adaptive cadence write vision.state[1] early (earlier boots measured a vision state's
    write at 0.5 s); at 30 kB/s its write outlasts block 2, whose scheduled state (every 2
    blocks) is queued behind it, not dropped. With no write measured, nothing is written early."""
    from hil.sim.lifecycle import Payload
    from hil.sim.platform import testbench_platform

    spec = spec_from_dir_tiny()
    request = Request(512, 40, 24, 2)
    geometry = Geometry(chunk=64, group=4, decode_every=8, vision_every=2)

    def vision_states(lengths, cadence, learned=None):
        platform = testbench_platform(
            1000.0, read_mbps=None, write_mbps=0.03, boot_s=2.0, first_start_s=0.0, setup_s=0.0, commit_latency_s=1e-3
        )
        platform.process_start_s = 1.0
        windows, start = _lived(lengths)
        payload = Payload(platform, windows, {}, cadence, write_s=learned)
        model = RequestModel(spec, request, platform, "orbitweaver", geometry, "chunk-first")
        resumed = Durable(inputs_stored=True, group=geometry.group)  # no TASK_INPUTS write in the way
        res = model.session(resumed, start + 2.0, payload.process(start, math.inf), None)
        return [c.value for c in res.commits if c.kind == "vision"], len(res.early_at)

    short = [2.5, 2.6, 2.7, 2.8, 100.0, 100.0]
    assert vision_states(short, "fixed") == ([2], 0)
    assert vision_states(short, "adaptive", {"vision": 0.5}) == ([1, 2], 1)
    assert vision_states(short, "adaptive") == ([2], 0)  # its cost unknown
    assert vision_states([500.0, 600.0, 700.0], "adaptive", {"vision": 0.5}) == ([2], 0)


def test_each_payload_process_starts_from_the_write_times_measured_before_it():
    """The simulated payload's state/write-costs: the process of the next window starts from
    what the one before measured by its cut; the first from what the run began with."""
    from hil.sim.lifecycle import Payload

    spec = spec_from_dir_tiny()
    geometry = Geometry(chunk=64, group=4, decode_every=8, vision_every=2)
    platform = _paced()
    windows, _ = _lived([60.0, 60.0, 60.0])
    payload = Payload(platform, windows, {}, "adaptive", write_s={"decode": 0.5})
    (a0, b0), (a1, b1) = windows[0], windows[1]
    first = payload.process(a0, b0)
    assert first.cadence.learned_writes() == {"decode": 0.5}
    RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", geometry, "chunk-first").session(
        Durable(), a0 + 2.0, first, None
    )
    second = payload.process(a1, b1)
    learned = second.cadence.learned_writes()
    assert learned == first.cadence.learned_writes() and "vision" in learned and learned["decode"] != 0.5
    # a session is modelled past its cut: what it would have measured after the cut is not carried
    windows, _ = _lived([8.0, 60.0])
    payload = Payload(platform, windows, {}, "adaptive")
    (a0, b0), (a1, b1) = windows[0], windows[1]
    first = payload.process(a0, b0)
    RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", geometry, "chunk-first").session(
        Durable(), a0 + 2.0, first, None
    )
    assert "decode" in first.cadence.learned_writes()  # the modelled session ran on into decode
    assert payload.process(a1, b1).cadence.learned_writes() == first.writes_measured_by(b0)
    assert "decode" not in first.writes_measured_by(b0)


def _throttled_platform(**options):
    """The testbench's emulation with 1 ms units and 1 MB/s storage."""
    from hil.sim.platform import testbench_platform

    return testbench_platform(
        1.0, read_mbps=1.0, write_mbps=1.0, boot_s=2.0, first_start_s=0.0, setup_s=0.0, commit_latency_s=1e-3, **options
    )


def test_chained_requests_share_their_process_storage_throttle():
    """Requests served one after the other by one payload process share its write token bucket
    (common.durable.ThrottledFS, empty at process start): the second request's TASK_INPUTS write
    finds the bucket the first one's writes left, not the burst a fresh process would have
    accrued by then."""
    from hil.sim.lifecycle import Payload

    spec = spec_from_dir_tiny()
    platform = _throttled_platform()  # units of 1 ms: the first request ends soon after its inputs' write
    geometry = Geometry(chunk=64, group=4, decode_every=8, vision_every=4)
    first, second = (RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", geometry) for _ in "ab")
    windows = [(0.0, math.inf)]
    shared = Payload(platform, windows)
    done = first.run(windows, 0.0, payload=shared).finished_at
    assert done is not None
    chained = second.run(windows, done, payload=shared)
    alone = second.run(windows, done, payload=Payload(platform, windows))
    assert chained.finished_at is not None and alone.finished_at is not None
    # the first request's writes drained the bucket: the second waits for most of the tokens a
    # fresh bucket would have held (its 4 MiB burst at 1 MB/s: 4.19 s), less what the first
    # request's last units let accrue
    burst_s = (4 << 20) / 1e6
    assert 0.8 * burst_s < chained.finished_at - alone.finished_at <= burst_s


def test_figure10_adds_orbitweaver_adaptive_beside_the_fixed_variants_unchanged():
    """Figure 10 at a real size on trace-a (short windows, FDIR once a minute): OrbitWeaver with
    the adaptive cadence is its own variant; it asks for early records, keeps the configured G
    (a decoder layer on a 1024-token chunk takes milliseconds on an Orin, far below any share of
    a window), and the fixed variants' rows and speedups are exactly those of a figure without it."""
    from hil.sim.figures import ADAPTIVE, GEOMETRY, Config, fig10, summarise10

    config = Config()
    variants = ("orbitweaver", ADAPTIVE, "sonic-layer", "hcache+")
    with_adaptive = fig10(config, traces_=("trace-a",), seeds=(0,), n_arrivals=8, policies=variants)
    without = fig10(config, traces_=("trace-a",), seeds=(0,), n_arrivals=8, policies=variants[:1] + variants[2:])
    fixed_rows = [r for r in with_adaptive["rows"] if r["policy"] != ADAPTIVE]
    assert fixed_rows == without["rows"]
    adaptive = [r for r in with_adaptive["rows"] if r["policy"] == ADAPTIVE]
    assert len(adaptive) == 8 and all(r["cadence"] == "adaptive" for r in adaptive)
    assert sum(r["early_records"] for r in adaptive) > 0
    assert {r["group"] for r in adaptive} == {GEOMETRY.group}
    assert all(r["early_records"] == 0 for r in fixed_rows)

    s = with_adaptive["summary"]
    assert s["speedup"] == without["summary"]["speedup"]  # against OrbitWeaver fixed, as before
    assert set(s["speedup"]) == set(s["speedup_adaptive"]) == {"sonic-layer", "hcache+"}
    assert set(s["completion"]) == set(variants)
    vs = s["adaptive_vs_fixed"]
    assert vs["early_records"] == sum(r["early_records"] for r in adaptive)
    assert vs["groups"] == {str(GEOMETRY.group): 8}
    both = [
        (f, a)
        for f, a in zip([r for r in fixed_rows if r["policy"] == "orbitweaver"], adaptive, strict=True)
        if f["completed"] and a["completed"]
    ]
    assert vs["pairs"] == len(both)
    assert summarise10(with_adaptive["rows"], variants) == s


def test_figure10_adaptive_variant_picks_smaller_blocks_where_a_block_outlasts_the_windows():
    """The adaptive variant on a platform whose prefill blocks are long against trace-a's
    windows (a paced testbench: one unit takes 8 s, a quarter of the median window lived through
    is about 6.5 s) picks G = 1 for arrivals after enough windows, where the fixed variant keeps
    the configured G."""
    from hil.sim.figures import ADAPTIVE, arrivals, summarise10, trace_for
    from hil.sim.lifecycle import Payload, trace_telemetry

    spec = spec_from_dir_tiny()
    platform = _paced(8000.0)
    geometry = Geometry(chunk=64, group=4, decode_every=8, vision_every=4)
    trace = trace_for("trace-a", 0)
    windows, warns = trace_windows(trace)
    rows = []
    for i, arrival in enumerate(arrivals(trace, 4)):
        for variant, cadence in (("orbitweaver", "fixed"), (ADAPTIVE, "adaptive")):
            model = RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", geometry, "chunk-first")
            payload = Payload(
                platform, windows, warns, cadence, trace_telemetry(trace), trace.telemetry_period_s or 1.0
            )
            o = model.run(windows, arrival, warns, horizon=trace.duration_s, payload=payload)
            rows.append(
                dict(trace="trace-a", seed=0, arrival=i, policy=variant, completed=o.completed, e2e_s=o.e2e_s)
                | dict(group=o.group, early_records=o.early_records)
            )
    assert {r["group"] for r in rows if r["policy"] == "orbitweaver"} == {4}
    assert 1 in {r["group"] for r in rows if r["policy"] == ADAPTIVE}
    assert summarise10(rows, ("orbitweaver", ADAPTIVE))["adaptive_vs_fixed"]["groups"].get("1", 0) >= 1


def test_the_payloads_own_data_moves_at_its_weight_through_the_shared_throttle():
    """With the testbench's --emulate-data-weight, a task's TASK_INPUTS write costs the device
    `weight` bytes per byte (common.durable.ThrottledFS.weighted), so a first start takes that
    much less, and the checkpoint records, charged in full, are unchanged."""
    from hil.sim.lifecycle import Payload
    from hil.sim.platform import testbench_platform

    spec = spec_from_dir_tiny()
    geometry = Geometry(chunk=64, group=4, decode_every=8, vision_every=4)
    windows = [(0.0, math.inf)]
    finished = {}
    for weight in (1.0, 0.25):
        platform = _throttled_platform(burst_bytes=0.0, data_weight=weight)
        assert platform.storage.data_weight == weight
        model = RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", geometry)
        finished[weight] = (model.run(windows, 0.0, payload=Payload(platform, windows)).finished_at, model.sizes)
    (full, sizes), (weighted, _) = finished[1.0], finished[0.25]
    # the TASK_PIXELS and TASK_INPUTS writes at 1 MB/s: 0.75 of their bytes no longer charged
    assert full - weighted == pytest.approx(0.75 * (sizes.task_pixels + sizes.task_inputs) / 1e6, rel=1e-6)
    # unthrottled storage has no weight: nothing to emulate
    native = testbench_platform(
        1.0,
        read_mbps=None,
        write_mbps=None,
        boot_s=0.0,
        first_start_s=0.0,
        setup_s=0.0,
        commit_latency_s=0.0,
        data_weight=0.25,
    )
    assert native.storage.data_weight == 1.0


def test_vision_out_written_in_the_gaps_shares_the_write_bucket_with_the_ordered_records():
    """vision.out goes in the background, in the gaps between ordered records, through the same
    token bucket (common.durable.ThrottledFS): what it writes, the next ordered record waits for.
    Nothing gets through faster than the throttle's rate."""
    from hil.sim.lifecycle import Commit, PayloadProcess, Writer

    platform = _throttled_platform()  # 1 MB/s, a bucket empty at the process's start (t = 0)
    writer = Writer(platform, sync=False, process=PayloadProcess(platform, 0.0))
    latency = platform.storage.write_latency_s
    vision_out = Commit(0, "vision_out", nbytes=2_000_000)
    writer.submit_background(0.0, vision_out)
    block = Commit(0, "block", (0, 0), (True, False), nbytes=1_000_000)
    writer.submit(1.0, block)
    # vision.out wrote the 1 MB the bucket let through by 1 s: the block waits a second for its own
    # (this machine's commit latency overlaps the wait)
    assert block.t == pytest.approx(2.0, abs=2 * latency)
    # ... and vision.out its last 1 MB after the block: 3 MB in 3 s
    assert writer.drain(block.t) == pytest.approx(3.0, abs=2 * latency)
    assert vision_out.t == pytest.approx(3.0, abs=2 * latency)


@pytest.mark.parametrize("vision_out_durable", [True, False])
def test_a_restart_that_recomputes_a_first_layer_block_needs_the_vision_output(vision_out_durable):
    """VisionPhase.out: a restart whose plan computes a first-layer block reads vision.out where
    it is durable, and otherwise runs the vision phase again from the newest vision state (and
    hands vision.out to the writer again)."""
    spec = spec_from_dir_tiny()
    platform = _paced(1000.0)
    model = RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", Geometry(64, 2, 8, 2))
    durable = Durable(
        vision_block=0 if vision_out_durable else 2,
        vision_done=vision_out_durable,
        blocks={(0, 0): (True, False)},
        inputs_stored=True,
        group=2,
    )
    res = model.session(durable, 10.0, 5.0)
    vision_states = [c for c in res.commits if c.kind == "vision"]
    vision_outs = [c for c in res.commits if c.kind == "vision_out"]
    if vision_out_durable:
        assert res.phase_s["vision"] == 0 and not vision_outs and not vision_states
    else:
        # blocks 2..3 of the tiny model's 4 again, one pace each
        assert res.phase_s["vision"] >= 2 * platform.vision_block_s
        assert len(vision_outs) == 1


def test_the_testbench_planner_costs_are_the_paced_payloads():
    """The simulated payload plans as the real paced one does (flight.engine.pacing
    paced_block_costs, PrefillRestore._plan_costs): a block lasts the pace per layer, a
    re-projection its share, a KV or hidden-state read its bytes at the emulated storage's rate,
    and the weights, which the testbench reads unthrottled, their own read time."""
    from flight.engine.pacing import REPROJECT_PACE_UNITS

    spec = spec_from_dir_tiny()
    platform = _throttled_platform()
    model = RequestModel(spec, Request(512, 40, 24, 2), platform, "orbitweaver", Geometry(64, 2, 8, 2))
    costs = model.costs
    (first, end), (start, stop) = model.groups[0], model.chunks[0]
    rate = platform.storage.read_bytes_per_s
    assert costs.weights[0] == pytest.approx(platform.weights_read_s / len(model.groups))
    assert costs.compute[0, 0] == pytest.approx((end - first) * platform.pace_s)
    assert costs.reproject[0, 0] == pytest.approx((end - first) * platform.pace_s * REPROJECT_PACE_UNITS)
    kv_bytes = (end - first) * (stop - start) * spec.text.kv_bytes_per_token_layer
    assert costs.kv[0, 0] == pytest.approx(kv_bytes / rate)
    assert costs.hidden[0, 0] == pytest.approx((stop - start) * spec.text.hidden * spec.dtype_bytes / rate)


@pytest.mark.parametrize("deepstack", [(1, 2), ()])
def test_a_deepstack_layer_needs_the_vision_output_too(deepstack):
    """Qwen3-VL adds visual features in its first decoder layers (DeepStack, one per
    `deepstack_visual_indexes`): a restart that computes a block of such a layer needs the
    vision output even with every first-layer block stored (PrefillRestore.vision_groups)."""
    from dataclasses import replace

    tiny = spec_from_dir_tiny()
    spec = replace(tiny, vision=replace(tiny.vision, deepstack=deepstack))
    model = RequestModel(spec, Request(512, 40, 24, 2), _paced(1000.0), "orbitweaver", Geometry(64, 1, 8, 2))
    first_layer = {(0, chunk): (True, True) for chunk in range(model.NC)}
    res = model.session(Durable(vision_block=2, blocks=first_layer, inputs_stored=True, group=1), 10.0, 5.0)
    rerun = [c for c in res.commits if c.kind == "vision_out"]
    assert (len(rerun), res.phase_s["vision"] > 0) == ((1, True) if deepstack else (0, False))
