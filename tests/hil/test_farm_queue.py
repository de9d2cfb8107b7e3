"""The bench farm's shared queue (hil/farm.py SharedQueue, BenchFarm.enqueue), without a cluster:
two campaigns planned as `hil.campaign` plans them, their runs' lengths expected by the lifecycle
simulator (hil/sim/plan.py), handed to one farm one after the other as make bench's two
end-to-end parts are. The runs go out longest expected first over both campaigns, and each
result goes back into its own campaign. (tests/hil/test_farm.py runs the dispatcher on a real
two-node Ray cluster.)"""

import heapq
import threading
from dataclasses import replace

import pytest
from testkit import short_trace

import traces
from hil.campaign import RunOutcome, plan_runs
from hil.farm import BenchFarm, QueuedRun, deliver, expected_wall_s
from hil.testbench import BenchConfig, BenchReport, default_workload

BENCHES = 2


def _plan(model, out, traces, policies):
    base = BenchConfig(trace=traces[0], model=model, out_dir=str(out), requests=1, time_scale=0.05, pace_ms=80)
    return plan_runs(base, traces, policies, [0], ["paper"], ["fixed"])


@pytest.fixture(scope="module")
def two_campaigns(model_dirs, tmp_path_factory):
    """Campaign "first" (handed in first: a one-cut short trace and the demo trace) and campaign
    "second" (trace-b and the short trace), with the simulator's expected lengths."""
    tmp = tmp_path_factory.mktemp("queue")
    short = short_trace(tmp / "short.jsonl")
    model = model_dirs["qwen3-vl"]
    first = _plan(model, tmp / "first", [short, "demo"], ["orbitweaver", "none"])
    second = _plan(model, tmp / "second", ["trace-b", short], ["orbitweaver", "sonic-layer"])
    expected = expected_wall_s(first + second, say=lambda line: None)
    return first, second, expected


class _Campaign:
    """What a campaign hears from the farm (run_campaign's `started` and `finished`)."""

    def __init__(self):
        self.finished: list[str] = []
        self.stop = threading.Event()

    def on_started(self, run, where):
        pass

    def on_finished(self, run, outcome):
        assert outcome.report.trace == run.cfg.trace  # its own run's report
        self.finished.append(run.cfg.out_dir)


def _report(run, wall_s):
    return BenchReport(run.cfg.trace, run.cfg.policy, 0.05, 80.0, 0.05, [], 0, 0, 0, 0.0, wall_s, 0.0, False)


def _drain(farm, benches):
    """Hand the queued runs out as the dispatcher does -- as many as there are benches, then one
    each time a bench frees (the run expected to end first ends first) -- and deliver each result;
    the order they went out in."""
    handed, under_way, clock = [], [], 0.0
    while True:
        while len(under_way) < benches and (item := farm.queue.take()) is not None:
            handed.append(item)
            heapq.heappush(under_way, (clock + item.expected_s, len(handed), item))
        if not under_way:
            return handed
        clock, _, item = heapq.heappop(under_way)
        deliver(item, RunOutcome(_report(item.run, item.expected_s), "bench b on node n"))


def test_both_campaigns_share_one_queue_longest_first_and_results_go_home(model_dirs, two_campaigns):
    first, second, expected = two_campaigns
    # the matrix is one where the order matters: the second campaign has runs longer than some
    # of the first's, and not every run is as long as every other
    assert max(expected[r.cfg.out_dir] for r in second) > min(expected[r.cfg.out_dir] for r in first)
    assert len({round(v, 3) for v in expected.values()}) > 2
    farm = BenchFarm("unused:0", campaigns=2)
    farm.expected_s.update(expected)
    heard = {"first": _Campaign(), "second": _Campaign()}
    campaigns = {
        name: farm.enqueue(runs, heard[name].on_started, heard[name].on_finished, heard[name].stop)
        for name, runs in (("first", first), ("second", second))
    }
    handed = _drain(farm, BENCHES)

    lengths = [item.expected_s for item in handed]
    assert lengths == sorted(lengths, reverse=True), "runs go out longest expected first, over both campaigns"
    owners = [item.campaign.name for item in handed]
    assert owners != sorted(owners, key=lambda name: name == campaigns["second"].name), (
        "the second campaign's long runs go out before the first campaign's short ones, not after all of them"
    )
    assert sorted(i.run.cfg.out_dir for i in handed) == sorted(r.cfg.out_dir for r in first + second)
    # every result back into its own campaign, once, and each campaign done
    for name, runs in (("first", first), ("second", second)):
        assert sorted(heard[name].finished) == sorted(r.cfg.out_dir for r in runs)
        assert campaigns[name].done.is_set() and not campaigns[name].left


def test_a_lost_run_goes_out_first_and_a_stopped_campaigns_runs_are_dropped(model_dirs, two_campaigns):
    first, second, expected = two_campaigns
    farm = BenchFarm("unused:0", campaigns=2)
    farm.expected_s.update(expected)
    heard = {"first": _Campaign(), "second": _Campaign()}
    one = farm.enqueue(first, heard["first"].on_started, heard["first"].on_finished, heard["first"].stop)
    farm.enqueue(second, heard["second"].on_started, heard["second"].on_finished, heard["second"].stop)
    shortest = min(first, key=lambda r: expected[r.cfg.out_dir])
    # its bench's node died under it: back in the queue, first in line whatever its length
    farm.queue.put(QueuedRun(one, shortest, expected[shortest.cfg.out_dir], again=True))
    assert farm.queue.take().run is shortest
    heard["first"].stop.set()  # the first campaign stops (Ctrl-C, or a run of it failed)
    handed = _drain(farm, BENCHES)
    assert [item.run.cfg.out_dir for item in handed] and all(item.campaign is not one for item in handed)
    assert heard["first"].finished == [] and sorted(heard["second"].finished) == sorted(r.cfg.out_dir for r in second)


def test_a_campaign_with_nothing_to_run_is_counted_as_handed_in():
    farm = BenchFarm("unused:0", campaigns=2)
    nothing = farm.enqueue([], lambda run, where: None, lambda run, outcome: None, threading.Event())
    assert nothing.done.is_set() and farm._checked_in == 1 and len(farm.queue) == 0


def test_the_plan_sees_a_runs_cut_and_a_run_that_never_completes(model_dirs, tmp_path):
    """The lifecycle simulator's prediction behind the expected lengths: on the one-cut short
    trace every request completes in the window after the cut (two power-ups); with a request
    whose compute cannot fit any window of the demo trace, the run plays the whole trace."""
    from hil.sim.plan import FIT, RunPredictor

    # as the campaign and bench farm tests fly it (bench/farm_bench.py one_campaign)
    cfg = BenchConfig(
        trace=short_trace(tmp_path / "short.jsonl"),
        model=model_dirs["qwen3-vl"],
        out_dir=str(tmp_path / "c"),
        requests=1,
        workload=default_workload(1, 12),
        time_scale=1.0,
        pace_ms=80,
        boot_trace_s=1.0,
    )
    predictor = RunPredictor()
    cut = predictor.predict(cfg)
    assert (cut.completed, cut.requests, cut.power_ups) == (1, 1, 2) and cut.end_trace_s < 60
    never = predictor.predict(replace(cfg, trace="demo", time_scale=0.05, pace_ms=60_000))
    assert never.completed == 0 and never.end_trace_s == traces.load("demo").duration_s
    assert FIT.wall_s(never) > FIT.wall_s(cut)


def test_the_fit_recovers_a_and_b_and_the_schedules_bound():
    from hil.sim.plan import FitRow, RunPrediction, fit, list_schedule, lower_bound

    rows = [
        FitRow(f"r{k}", 0.5 * trace_s + 7.0 + 0.25 * ups, RunPrediction(trace_s, ups, 1, 1, 0.5, trace_s))
        for k, (trace_s, ups) in enumerate([(100.0, 1), (300.0, 9), (50.0, 4), (800.0, 30)])
    ]
    fitted = fit(rows)
    assert fitted.a_s == pytest.approx(7.0) and fitted.b_s == pytest.approx(0.25)
    assert fitted.max_error == pytest.approx(0.0, abs=1e-9) and fitted.loo_max_error == pytest.approx(0.0, abs=1e-9)
    lengths = [5.0, 4.0, 3.0, 3.0, 3.0]  # LPT on 2 benches: 5+3, 4+3+3 -> 10; the bound is 9
    assert list_schedule(lengths, 2) == 10.0 and lower_bound(lengths, 2) == 9.0
    assert list_schedule([1.0, 9.0], 4, overhead_s=1.0) == lower_bound([1.0, 9.0], 4, overhead_s=1.0) == 10.0
