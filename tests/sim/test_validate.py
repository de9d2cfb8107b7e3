"""The simulator's validation against a testbench run directory: every request of the run is
predicted, in the order the payload served them, each one chained after the simulator's own
prediction of the one before; each request's shape and the geometry come from the run.

The run directory is written with the project's own writers (BusLog, the wire encoder, the
testbench's report), as a testbench run leaves it: two requests uplinked together, served one
after the other in one long power window.
"""

import json

import pytest

from common.wire import Apid, NodeId, encode
from common.wire import messages as m
from flight.checkpoint.policies import Geometry
from ground.images import prepare_images
from hil.bus import buslog as bl
from hil.sim.validate import run_facts, simulate_run, validate
from hil.testbench import BenchReport, RequestReport

FLIGHT_ARGS = ["--policy", "orbitweaver", "--chunk", "16", "--group", "2", "--decode-every", "2"]
FLIGHT_ARGS += ["--vision-every", "1", "--planner", "optimal", "--pace-ms", "100.000", "--device", "cpu"]
FLIGHT_ARGS += ["--cadence", "fixed"]  # the testbench names the cadence it runs; the simulator models the fixed one
PROMPTS = ("count the ships near the coast", "describe the clouds and report what is visible below them")
ANSWERS = (5, 7)  # tokens of each request's uninterrupted answer (references.json)


def _trace(path, duration):
    import traces
    from traces.model import CutCause, PowerWindow

    traces.dump(
        traces.Trace.from_windows(
            "validate",
            duration,
            [PowerWindow(0.0, 5.0, CutCause.FDIR, 0.0)]
            + (
                [PowerWindow(8.0, 16.0, CutCause.FDIR, 0.0), PowerWindow(20.0, duration, None, 0.0)]
                if duration > 20.0
                else [PowerWindow(8.0, duration, None, 0.0)]
            ),
            reference_request_s=10,
            description="test trace",
            source={"kind": "manual"},
            assumptions=["for the validation test"],
        ),
        path,
    )
    return str(path)


def _report(log, t, kind, task_id, **fields):
    request = {"apid": Apid.PAYLOAD, "source": 1, "seq": 7 + int(task_id[1:]), "type": "UPLINK_TASK"}
    log.write(bl.PAYLOAD_REPORT, trace_s=t, clock_s=t, type=kind, task_id=task_id, request=request, **fields)


def _run_dir(root, image_files, trace_path, model_dir):
    """A finished testbench run: r00 and r01 accepted at 10 s, r00 served 10.2-14.0, r01 started
    by the payload's queue as r00 completed (14.1), cut at 16 s, resumed after the power-up at
    20 s (a boot of 1.5 s) and completed at 24 s; trace seconds at time scale 1."""
    run = root / "run"
    log = bl.BusLog(run / "bus" / bl.LOG_FILE, run_id="run-1")
    log.write(
        bl.RUN_START,
        trace_s=0.0,
        clock_s=0.0,
        trace="validate",
        trace_path=trace_path,
        time_scale=1.0,
        start_at_s=0.0,
        flight_args=FLIGHT_ARGS,
        model=model_dir,
    )
    log.write(bl.POWER_ON, trace_s=0.0, clock_s=0.0, cause="restored", pid=1)
    log.write(bl.POWER_OFF, trace_s=5.0, clock_s=5.0, cause="fdir", origin="trace", pid=1)
    log.write(bl.POWER_ON, trace_s=8.0, clock_s=8.0, cause="restored", pid=2)
    images = prepare_images(image_files[:2])
    seq = 0
    for image in images:
        for chunk in image.chunks(4096):
            packet = encode(chunk, Apid.PAYLOAD, seq, source_id=NodeId.GROUND)
            log.write(bl.COMMAND_RECEIVED, trace_s=9.0, clock_s=9.0, type="IMAGE_CHUNK", packet=_b64(packet))
            seq += 1
    for i, prompt in enumerate(PROMPTS):
        task = m.UplinkTask(
            task_id=f"r0{i}",
            prompt=prompt,
            images=[image.name for image in images],
            max_new_tokens=12,
            priority=0,
        )
        packet = encode(task, Apid.PAYLOAD, seq + i, source_id=NodeId.GROUND)
        log.write(bl.COMMAND_RECEIVED, trace_s=9.5, clock_s=9.5, type="UPLINK_TASK", packet=_b64(packet))
    _report(log, 10.0, "ACCEPTED", "r00")
    _report(log, 10.05, "ACCEPTED", "r01")
    for task_id, sessions, end in (("r00", [(10.2, 1, 5)], 14.0), ("r01", [(14.1, 1, 3), (21.5, 3, 5)], 24.0)):
        for start, first_block, stop_block in sessions:
            if start > 20.0 > start - 5:
                log.write(bl.POWER_OFF, trace_s=16.0, clock_s=16.0, cause="fdir", origin="trace", pid=2)
                log.write(bl.POWER_ON, trace_s=20.0, clock_s=20.0, cause="restored", pid=3)
            _report(log, start, "STARTED", task_id)
            if task_id == "r00":  # the uplink of r01 still reaches the payload as r00 sets up
                log.write(bl.COMMAND_FORWARDED, trace_s=10.3, clock_s=10.3, type="IMAGE_QUERY", task_id=None)
            for block in range(first_block, stop_block):
                t = start + 0.2 + 0.1 * (block - first_block + 1)
                _report(log, t, "PROGRESS", task_id, phase="vision", done=block, total=4)
        _report(log, end, "COMPLETED", task_id)
    log.close()
    requests = [
        RequestReport(f"r0{i}", prompt, ["img0.png", "img1.png"], True, True, 1.0, e2e, 0, [], [], None, tokens)
        for i, (prompt, e2e, tokens) in enumerate(zip(PROMPTS, (4.0, 13.95), ANSWERS, strict=True))
    ]
    report = BenchReport(trace_path, "orbitweaver", 1.0, 100.0, 1.0, requests, 2, 1, 0, 0.0, 20.0, 1.0, True)
    (run / "report.json").write_text(json.dumps(report.to_json(), indent=2))
    # the payload's log (every boot's, appended): r01's cadence asked for two early records,
    # the second line torn by the cut
    (run / "bus" / "payload.log").write_text(
        '{"event": "flight_booted", "boot": 1, "cadence": "adaptive"}\n'
        '{"task_id": "r01", "phase": "vision", "event": "early_record", "level": "info"}\n'
        '{"task_id": "r01", "phase": "vision", "event": "early_rec\n'
        '{"task_id": "r01", "phase": "decode", "event": "early_record", "level": "info"}\n'
    )
    (run / "references.json").write_text(json.dumps([{"token_ids": list(range(n))} for n in ANSWERS]))
    return str(run)


def _b64(packet: bytes) -> str:
    import base64

    return base64.b64encode(packet).decode("ascii")


@pytest.fixture
def run_dir(tmp_path, image_files, model_dirs):
    return _run_dir(tmp_path, image_files, _trace(tmp_path / "trace.jsonl", 200.0), model_dirs["qwen3-vl"])


def test_every_request_is_validated_and_each_is_chained_after_the_prediction_before_it(run_dir, model_dirs, tmp_path):
    # The spec passed in is wrong on purpose (missing images, another prompt, length and
    # geometry): everything the run records must be taken from the run.
    # ... the model too: the run names its own; the one given stands in only where that is gone
    result = validate(
        [run_dir], "/nonexistent/model", ["/nonexistent.png"], "other", 99, Geometry(64, 4, 8, 4), str(tmp_path)
    )
    rows = result["rows"]
    assert [(r["request"], r["task_id"]) for r in rows] == [(0, "r00"), (1, "r01")]
    assert all(r["spec_from"] == "prompt: run,images: run,tokens: run" for r in rows)
    assert [r["new_tokens"] for r in rows] == list(ANSWERS)
    assert rows[0]["text_tokens"] < rows[1]["text_tokens"]  # each request's own prompt
    assert rows[0]["visual_tokens"] == rows[1]["visual_tokens"] > 0
    assert all(r["geometry"] == {"chunk": 16, "group": 2, "decode_every": 2, "vision_every": 1} for r in rows)
    assert {r["model"] for r in rows} == {model_dirs["qwen3-vl"]}  # the run names its model: that one
    assert [r["e2e_trace_s"] for r in rows] == pytest.approx([4.0, 13.95])
    first, second = rows
    assert first["predicted_completed"] and second["predicted_completed"]
    assert not first["chained"] and first["arrival_s"] == pytest.approx(10.0)
    # the second request reaches the payload when the simulator says the first completes ...
    assert second["chained"] and second["arrival_s"] == first["predicted_finished_s"]
    # ... and its end-to-end time counts from its own (real) acceptance
    assert second["predicted_e2e_trace_s"] == pytest.approx(second["predicted_finished_s"] - 10.05)
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_e2e_trace_s"] / r["e2e_trace_s"] - 1)
    assert result["max_abs_error"] == max(abs(r["error"]) for r in rows)
    assert result["requests"] == 2 and result["completion_misses"] == 0 and all(r["comparable"] for r in rows)


def test_run_facts_count_the_early_records_the_payload_logged(run_dir, tmp_path):
    facts = run_facts(run_dir)
    assert {t["task_id"]: t["early_records"] for t in facts["tasks"]} == {"r00": 0, "r01": 2}
    log = tmp_path / "run" / "bus" / "payload.log"
    # a payload from before the count (its boot names no cadence): unknown, not 0
    log.write_text('{"event": "flight_booted", "boot": 1}\n')
    assert {t["early_records"] for t in run_facts(run_dir)["tasks"]} == {None}
    log.unlink()  # a run that kept no payload log: unknown too
    assert {t["early_records"] for t in run_facts(run_dir)["tasks"]} == {None}


def test_run_facts_merge_boots_over_tasks_and_follow_the_served_order(run_dir):
    facts = run_facts(run_dir)
    assert [t["task_id"] for t in facts["tasks"]] == ["r00", "r01"]
    assert facts["tasks"][1]["started_s"] == [pytest.approx(14.1), pytest.approx(21.5)]
    # a fact of the payload, from any task: r01's restart after the power-up at 20 s; not the
    # power-up at 8 s, where r00 started only once it had been uplinked
    assert facts["boot_by_power_up"] == {20.0: pytest.approx(1.5)} and facts["boot_trace_s"] == pytest.approx(1.5)
    assert facts["boot_starts"] == {20.0: ("r01", True)}  # a restart: after its TASK_INPUTS read
    # setup: STARTED to the first vision report, per session, first starts (inputs built and
    # written) and restarts apart; a first start is its own (r00's shared the payload with an
    # uplinked command: that is part of it); r00 has no restart, so its restart setup comes from
    # r01's
    r00, r01 = facts["tasks"]
    assert [(round(s, 3), block, uplink, first) for s, block, uplink, first, _ in r00["first_units"]] == [
        (0.3, 0, True, True)
    ]
    assert [(round(s, 3), block, uplink, first) for s, block, uplink, first, _ in r01["first_units"]] == [
        (0.3, 0, False, True),
        (0.3, 2, False, False),
    ]
    assert r00["first_setup_samples"] == r00["first_units"]
    assert r01["first_setup_samples"] == r01["first_units"][:1]
    assert r00["setup_samples"] == r01["setup_samples"] == r01["first_units"][1:]
    assert facts["cadence"] == "fixed" and facts["planner"] == "optimal"


def test_a_request_behind_one_predicted_not_to_complete_is_predicted_not_to_complete(run_dir, model_dirs, tmp_path):
    from hil.sim.validate import RequestShapes

    facts = run_facts(run_dir)
    # the trace ends 0.5 s after the first request was accepted: it cannot complete
    facts["trace_path"] = _trace(tmp_path / "short.jsonl", 10.5)
    shapes = RequestShapes(model_dirs["qwen3-vl"])
    requests = [shapes(t["spec"]["images"], t["spec"]["prompt"], t["spec"]["tokens"]) for t in facts["tasks"]]
    first, second = simulate_run(facts, model_dirs["qwen3-vl"], requests, Geometry(16, 2, 2, 1), 1e-3)
    assert first["predicted_completed"] is False and first["predicted_e2e_trace_s"] is None
    assert second["predicted_completed"] is False and second["predicted_e2e_trace_s"] is None
    # the same where a wall-clock limit stopped the run before its trace ended
    facts["stopped_trace_s"] = 10.4
    for task in facts["tasks"]:
        task["e2e_trace_s"] = None
    assert simulate_run(facts, model_dirs["qwen3-vl"], requests, Geometry(16, 2, 2, 1), 1e-3) == [first, second]


def test_a_run_stopped_before_its_trace_ended_is_predicted_up_to_its_stop(run_dir, model_dirs, tmp_path):
    """A run stopped by a wall-clock limit says nothing of what would have finished after it: a
    prediction past the stop is 'unfinished then', in agreement with a run that did not finish."""
    from hil.sim.validate import RequestShapes

    facts = run_facts(run_dir)
    assert facts["stopped_trace_s"] is None  # no run_stop entry: the trace's end is the horizon
    shapes = RequestShapes(model_dirs["qwen3-vl"])
    requests = [shapes(t["spec"]["images"], t["spec"]["prompt"], t["spec"]["tokens"]) for t in facts["tasks"]]
    free = simulate_run(facts, model_dirs["qwen3-vl"], requests, Geometry(16, 2, 2, 1), 1e-3)
    assert all(p["predicted_completed"] for p in free)
    facts["stopped_trace_s"] = (free[0]["predicted_finished_s"] + free[1]["predicted_finished_s"]) / 2
    # a request the run finished is compared as it is, whenever the simulator finishes it ...
    assert simulate_run(facts, model_dirs["qwen3-vl"], requests, Geometry(16, 2, 2, 1), 1e-3) == free
    # ... one it left unfinished is predicted up to the stop
    facts["tasks"][1]["e2e_trace_s"] = None
    first, second = simulate_run(facts, model_dirs["qwen3-vl"], requests, Geometry(16, 2, 2, 1), 1e-3)
    assert first == free[0]
    assert second["predicted_completed"] is False and second["predicted_after_stop"]
    assert second["predicted_e2e_trace_s"] is None
    # the bus log's run_stop before any trace_end is what sets the horizon
    log = bl.BusLog(tmp_path / "run" / "bus" / bl.LOG_FILE, run_id="run-1")
    log.write(bl.RUN_STOP, trace_s=30.0, clock_s=30.0, reason="SIGTERM", stored_commands=0)
    log.close()
    assert run_facts(run_dir)["stopped_trace_s"] == pytest.approx(30.0)


def test_recorded_options_in_either_form():
    from hil.sim.validate import _option

    args = ["--chunk", "8", "--cadence=adaptive", "--group"]
    assert _option(args, "--chunk") == "8"
    assert _option(args, "--cadence") == "adaptive"
    assert _option(args, "--group") is None  # a flag last, without its value
    assert _option(args, "--planner") is None


def test_the_run_platform_charges_the_payloads_data_at_the_weight_it_flew():
    from hil.sim.validate import _run_platform

    throttled = ["--emulate-read-mbps", "0.5", "--emulate-write-mbps", "0.25"]
    facts = {"time_scale": 0.5, "pace_ms": 300.0, "process_start_trace_s": 15.0}
    weighted = _run_platform({**facts, "flight_args": [*throttled, "--emulate-data-weight", "0.25"]}, 1e-3)
    assert weighted.storage.data_weight == 0.25
    assert weighted.storage.write_bytes_per_s == pytest.approx(0.25e6 * 0.5)  # per trace second
    # a run from before the weight: its payload charged its data in full
    assert _run_platform({**facts, "flight_args": throttled}, 1e-3).storage.data_weight == 1.0


def test_a_late_first_boot_starts_its_process_and_its_storage_throttle_late():
    """The emulated boot forks at power-up and the payload process (its throttle's buckets, empty
    then) starts 15 trace s later; a boot whose connection came 12 s later than the others'
    (a loaded machine) started its process 12 s later too (docs/sim.md, "Validation"): its
    buckets hold 12 s less, its first TASK_INPUTS write ends later."""
    from hil.sim.lifecycle import Payload
    from hil.sim.validate import _run_platform, process_starts

    facts = {
        "time_scale": 0.6,
        "pace_ms": 600.0,
        "process_start_trace_s": 15.0,
        "flight_args": ["--emulate-read-mbps", "0.5", "--emulate-write-mbps", "0.3"],
        "connected_by_power_up": {0.0: 27.3, 94.0: 15.2, 192.0: 15.4, 290.0: 15.3, 329.0: 15.3},
    }
    starts = process_starts(facts)
    assert starts[0.0] == pytest.approx(27.0) and starts[94.0] == 15.0 and starts[192.0] == pytest.approx(15.1)
    platform = _run_platform(facts, 1e-3)
    payload = Payload(platform, [(0.0, 45.0), (94.0, 143.0)])
    assert payload.process(0.0, 45.0).started == pytest.approx(27.0)
    assert payload.process(94.0, 143.0).started == pytest.approx(109.0)
    late, usual = payload.process(0.0, 45.0), Payload(_run_platform({**facts, "connected_by_power_up": {}}, 1e-3), [])
    nbytes = 3e6  # a first start's TASK_PIXELS and TASK_INPUTS, device bytes, written at trace 31
    assert late.write_wait(31.0, nbytes) > usual.process(0.0, 45.0).write_wait(31.0, nbytes) + 10.0
    # an exec'd payload (no emulated boot) starts its process at power-up, however long it boots
    assert process_starts({**facts, "process_start_trace_s": 0.0}) == {}


def test_a_run_copied_elsewhere_still_finds_the_trace_it_flew(tmp_path):
    """The bus log records the trace's absolute path; once the checkout that recorded it is gone
    the validation finds the same trace without it, and says so when it cannot."""
    import traces
    from hil.campaign import trace_for_seed
    from hil.sim.validate import run_trace

    campaign = tmp_path / "campaign"
    flown = traces.load(trace_for_seed("trace-a", 1, campaign))  # written where a campaign keeps it
    run_dir = str(campaign / "runs" / "trace-a-paper-s1-orbitweaver")
    gone = "/nonexistent/checkout/runs/bench/e2e/traces/trace-a-seed1.jsonl"
    assert run_trace({"trace_path": gone, "trace": "trace-a-seed1", "run_dir": run_dir}) == flown
    # a run directory copied without its campaign's traces: the same seed generated again
    elsewhere = str(tmp_path / "copied" / "runs" / "trace-a-paper-s1-orbitweaver")
    assert run_trace({"trace_path": gone, "trace": "trace-a-seed1", "run_dir": elsewhere}) == flown
    shipped = run_trace(
        {"trace_path": "/nonexistent/traces/data/trace-b.jsonl", "trace": "trace-b", "run_dir": elsewhere}
    )
    assert shipped == traces.load(traces.shipped_path("trace-b"))
    with pytest.raises(FileNotFoundError, match="is gone"):
        run_trace({"trace_path": "/nonexistent/mine.jsonl", "trace": "mine", "run_dir": elsewhere})


class _Entry(dict):
    """A bus-log payload report as `_task_facts` reads it."""

    def __init__(self, t, **fields):
        super().__init__(fields)
        self.stamped_trace_s = t


def test_a_session_after_one_cut_before_any_unit_builds_the_inputs_again():
    """The inputs are written after STARTED and before the first unit: a first session cut
    before any unit left none, so the next one is a first start again (it builds and writes
    them), and its setup sample counts as a first start's."""
    from hil.sim.validate import _task_facts

    mine = [
        _Entry(10.0, type="ACCEPTED"),
        _Entry(10.1, type="STARTED"),  # cut at 13 before any unit
        _Entry(20.0, type="STARTED"),
        _Entry(38.0, type="PROGRESS", phase="vision", done=1),
        _Entry(50.0, type="STARTED"),
        _Entry(52.0, type="PROGRESS", phase="vision", done=3),
    ]
    facts = _task_facts("r00", mine, [])
    assert facts["inputs_stored"] == [False, False, True]
    assert [(round(u[0], 1), u[1], u[3]) for u in facts["first_units"]] == [(18.0, 0, True), (2.0, 2, False)]


def test_requests_beyond_ten_percent_are_counted_by_how_many_cuts_apart():
    """Beside the goal, the report says where the misses stand: a simulation that finishes a
    request after one cut more than the run is one power cycle off however close it came."""
    from bench.report import validation_lines
    from hil.sim.validate import beyond_by_cuts

    rows = [
        {"error": 0.02, "cuts": 5, "predicted_cuts": 5},  # within: not counted
        {"error": 0.103, "cuts": 5, "predicted_cuts": 6},
        {"error": -0.14, "cuts": 7, "predicted_cuts": 6},
        {"error": 0.3, "cuts": 4, "predicted_cuts": 4},
        {"error": 0.5, "cuts": 9, "predicted_cuts": 12},
        {"error": None, "cuts": 3, "predicted_cuts": 3},  # not compared
    ]
    apart = beyond_by_cuts(rows)
    assert apart == {"same_cuts": 1, "one_cut": 2, "more_cuts": 1}
    val = {
        "rows": [],
        "commit_latency_s": 5e-4,
        "max_abs_error": 0.5,
        "within_10_percent": False,
        "beyond_10_percent_by_cuts": apart,
    }
    text = "\n".join(validation_lines({"validation": val}))
    assert "NOT within 10 %" in text
    assert "Of the 4 beyond 10 %, the simulation counts the run's cuts in 1, one cut more or fewer in 2" in text


def test_each_request_is_also_simulated_behind_the_one_before_as_it_ran(run_dir, model_dirs, tmp_path):
    """The diagnosis beside the verdict: request k again, from the moment request k-1 really
    completed (its acceptance plus its measured end-to-end time), in fresh payload processes;
    request 0 has nothing before it and is the same prediction."""
    facts = run_facts(run_dir)
    from hil.sim.validate import RequestShapes

    shapes = RequestShapes(model_dirs["qwen3-vl"])
    requests = [shapes(t["spec"]["images"], t["spec"]["prompt"], t["spec"]["tokens"]) for t in facts["tasks"]]
    geometry = Geometry(16, 2, 2, 1)
    chained = simulate_run(facts, model_dirs["qwen3-vl"], requests, geometry, 1e-3)
    behind_real = simulate_run(facts, model_dirs["qwen3-vl"], requests, geometry, 1e-3, predecessor="measured")
    first = facts["tasks"][0]
    assert behind_real[0] == chained[0]
    assert chained[1]["arrival_s"] == chained[0]["predicted_finished_s"]
    assert behind_real[1]["arrival_s"] == pytest.approx(first["accepted_s"] + first["e2e_trace_s"])
    assert behind_real[1]["arrival_s"] != chained[1]["arrival_s"]
    with pytest.raises(ValueError, match="predecessor"):
        simulate_run(facts, model_dirs["qwen3-vl"], requests, geometry, 1e-3, predecessor="guessed")

    rows = validate([run_dir], model_dirs["qwen3-vl"], [], "x", 8, geometry, str(tmp_path), commit_latency_s=1e-3)[
        "rows"
    ]
    assert rows[0]["error_given_previous"] == rows[0]["error"]
    assert rows[1]["predicted_e2e_given_previous_s"] == pytest.approx(
        behind_real[1]["predicted_finished_s"] - facts["tasks"][1]["accepted_s"]
    )
    assert rows[1]["error_given_previous"] == pytest.approx(
        rows[1]["predicted_e2e_given_previous_s"] / rows[1]["e2e_trace_s"] - 1
    )


def test_requests_beyond_ten_percent_are_split_by_whether_they_inherit_the_error():
    from bench.report import given_previous_cell, validation_lines
    from hil.sim.validate import beyond_given_previous

    rows = [
        {"request": 1, "error": 0.02, "error_given_previous": 0.30},  # within: not counted
        {"request": 1, "error": -0.09 - 0.01, "error_given_previous": 0.003},  # -10 %: within
        {"request": 1, "error": -0.12, "error_given_previous": 0.004},  # inherited
        {"request": 2, "error": 0.25, "error_given_previous": 0.11},  # its own
        {"request": 0, "error": 0.4, "error_given_previous": 0.4},  # its own
        {"request": 1, "error": 0.2, "error_given_previous": None},  # nothing to compare: its own
    ]
    assert beyond_given_previous(rows) == {"inherited": 1, "own": 3}
    assert given_previous_cell(rows[2]) == "+0.4 %" and given_previous_cell(rows[4]) == "-"
    val = {
        "rows": [],
        "commit_latency_s": 5e-4,
        "max_abs_error": 0.4,
        "within_10_percent": False,
        "beyond_10_percent_given_previous": beyond_given_previous(rows),
    }
    text = "\n".join(validation_lines({"validation": val}))
    assert "1 of them are within 10 % (the error is inherited from the request before) and 3 are not" in text


def test_the_verdict_is_a_json_bool_and_the_report_reads_it_from_the_numbers(run_dir, model_dirs, tmp_path):
    """The simulator's errors are numpy floats: a numpy bool verdict went to JSON as the string
    "False", and the report, reading it as true, said "within 10 %" of a validation that was not."""
    from bench.report import validation_lines, validation_within

    result = validate(
        [run_dir], model_dirs["qwen3-vl"], [], "x", 8, Geometry(16, 2, 2, 1), str(tmp_path), commit_latency_s=1e-3
    )
    stored = json.loads(json.dumps(result, default=str))
    assert type(stored["within_10_percent"]) is bool and type(stored["max_abs_error"]) is float
    # a validation stored before the fix: the flag is a string, the numbers say beyond
    old = {
        "rows": [],
        "commit_latency_s": 1e-3,
        "max_abs_error": 0.16,
        "completion_misses": 0,
        "within_10_percent": "False",
    }
    assert not validation_within(old)
    assert "NOT within 10 %" in "\n".join(validation_lines({"validation": old}))
    assert not validation_within({**old, "max_abs_error": 0.05, "completion_misses": 2})
    assert validation_within({**old, "max_abs_error": 0.05})
