"""A short campaign (2 traces x 2 policies) end to end with real processes, and its report. The
payloads are forked from the bus's zygote with an emulated boot (hil/bus/zygote.py): every output is
still checked bit for bit against its uninterrupted reference."""

import itertools
import json
from pathlib import Path

import pytest
from testkit import HANG_S, short_trace

from hil.campaign import run_campaign
from hil.testbench import BenchConfig, default_workload


@pytest.mark.slow
def test_short_campaign_end_to_end(model_dirs, tmp_path):
    base = BenchConfig(
        trace="demo",
        model=model_dirs["qwen3-vl"],
        out_dir=str(tmp_path / "campaign"),
        requests=1,
        workload=default_workload(1, 12),
        time_scale=1.0,
        pace_ms=80,
        boot_trace_s=1.0,
    )
    short = short_trace(tmp_path / "short.jsonl")
    first: list[str] = []
    cells = run_campaign(base, [short, "demo"], ["orbitweaver", "none"], [0], say=first.append, jobs=2)
    assert len(cells) == 4
    # what a person reads: how many runs, how to stop and go on, and counters in the order things
    # happen (the first line of a 40-run campaign read 11/40: a run's place in the plan)
    assert first[0].startswith("[campaign] 4 runs (2 trace(s) x 1 workload(s) x 1 seed(s) x 2 policy variant(s))")
    assert first[0].endswith(": 4 to run") and "with --resume keeps every finished run" in first[1]
    starting = [line.split(" starting:")[0] for line in first if " starting: " in line]
    assert starting == [f"[campaign] run {k}/4" for k in range(1, 5)]
    done = [line.split(" done:")[0] for line in first if " done: " in line]
    assert done == [f"[campaign] {k}/4" for k in range(1, 5)]
    # no cadence named: each policy flies its default, and the label says which orbitweaver's is
    ours = "orbitweaver (adaptive)"
    assert {(c.policy, c.cadence, c.report.cadence) for c in cells} == {
        (ours, "adaptive", "adaptive"),
        ("none", "fixed", "fixed"),
    }
    for cell in cells:
        r = cell.report
        assert r.power_cycles >= 1
        done = [q for q in r.requests if q.completed]
        assert all(q.correct for q in done)
    # orbitweaver finishes its request on both traces
    assert all(c.report.completion_rate == 1.0 for c in cells if c.policy == ours)
    report = (tmp_path / "campaign" / "report.md").read_text()
    assert f"| demo | paper | {ours} |" in report and "| short | paper | none |" in report
    assert "| paper | demo | 1/1 (100%)" in report  # the summary: orbitweaver's completion first
    for png in ("e2e.png", "completion.png", "bytes.png"):
        assert (tmp_path / "campaign" / png).stat().st_size > 1000
    rows = json.loads((tmp_path / "campaign" / "campaign.json").read_text())["rows"]
    assert {(r["trace"], r["policy"]) for r in rows} == {(t, p) for t in (short, "demo") for p in (ours, "none")}
    # the cut in the short trace lands inside the request: orbitweaver resumes, none starts over
    by_policy = {c.policy: c.report for c in cells if c.trace == short}
    assert by_policy[ours].cuts_total >= 1
    # runs start one at a time: each bus starts only once the run before it has its clock
    # running (its zygote's imports done), so no run's first windows share the CPU with them
    starts = []
    for cell in cells:
        with open(Path(cell.report_dir) / "bus" / "bus-log.jsonl") as f:
            entries = [json.loads(line) for line in f]
        bus_started = entries[0]["utc"]
        assert entries[0]["kind"] == "run_start"
        clock = next(e for e in entries[1:] if e.get("trace_s") is not None)
        starts.append((bus_started, clock["utc"] - clock["wall_s"]))
    starts.sort()
    for (_, clock_started), (next_bus_started, _) in itertools.pairwise(starts):
        assert next_bus_started >= clock_started, starts
    # the payload's log is where the validation reads the early records the cadence asked for
    from hil.sim.validate import run_facts

    for cell in cells:
        assert all(t["early_records"] is not None for t in run_facts(cell.report_dir)["tasks"]), cell.report_dir

    # resumed into the same directory: every finished run is kept as it was, none runs again
    # (a run would rewrite its bus log)
    logs = sorted((tmp_path / "campaign" / "runs").glob("*/bus/bus-log.jsonl"))
    assert len(logs) == 4
    before = {log: log.stat().st_mtime_ns for log in logs}
    said: list[str] = []
    again = run_campaign(base, [short, "demo"], ["orbitweaver", "none"], [0], say=said.append, jobs=2, resume=True)
    assert sum("(kept from an earlier campaign)" in line for line in said) == 4
    assert said[0].endswith("4 kept from an earlier campaign, 0 to run") and "starting" not in " ".join(said)
    assert {log: log.stat().st_mtime_ns for log in logs} == before
    assert [c.report.to_json() for c in again] == [c.report.to_json() for c in cells]

    # stopped (a Ctrl-C sets the event): no run starts, none is emptied or recorded
    import threading

    stopped = threading.Event()
    stopped.set()
    said.clear()
    none = run_campaign(base, [short, "demo"], ["orbitweaver", "none"], [0], say=said.append, jobs=2, stop=stopped)
    assert none == [] and not any("starting" in line for line in said)
    assert {log: log.stat().st_mtime_ns for log in logs} == before

    # A run a stopped campaign cut short (its record not yet written) runs again from nothing:
    # not on top of the payload's queue and checkpoints it left, nor appending to its bus log.
    from hil.bus import buslog as bl
    from hil.campaign import RUN_RECORD

    cut_short = next(c for c in cells if c.trace == short and c.policy == ours)
    (Path(cut_short.report_dir) / RUN_RECORD).unlink()
    said.clear()
    run_campaign(base, [short, "demo"], ["orbitweaver", "none"], [0], say=said.append, jobs=2, resume=True)
    assert sum("(kept from an earlier campaign)" in line for line in said) == 3
    assert said[0].endswith("3 kept from an earlier campaign, 1 to run")
    assert sum(line.startswith("[campaign] run 1/1 starting: ") for line in said) == 1
    log = Path(cut_short.report_dir) / "bus" / bl.LOG_FILE
    assert len(bl.runs(bl.read_log(log))) == 1  # one bus run in its log: the new one
    boots = [e for e in bl.read_log(log) if e.kind == bl.PAYLOAD_REPORT and e.get("event") == "BOOT"]
    assert "payload boot 1;" in boots[0].get("text"), boots[0]  # a payload that never booted before

    # A run the simulator missed runs again with its own configuration (make bench's `repeats`):
    # the same trace, policy and requests, every output checked again, the validated run's time
    # beside the repeat's.
    from bench.sim_figures import repeats
    from hil.campaign import _config_key, config_of_run

    demo_ow = next(c for c in cells if c.trace == "demo" and c.policy == ours)
    record = json.loads((Path(demo_ow.report_dir) / RUN_RECORD).read_text())
    assert _config_key(config_of_run(demo_ow.report_dir)) == record["config"]
    measured = demo_ow.report.requests[0].e2e_trace_s
    missed_row = {
        "run_dir": demo_ow.report_dir,
        "request": 0,
        "trace": "demo",
        "policy": "orbitweaver",
        "cadence": "adaptive",
        "comparable": True,
        "e2e_trace_s": measured,
        "predicted_completed": True,
        "predicted_e2e_trace_s": measured * 2,  # a prediction 100 % off: a miss
        "predicted_cuts": 3,
        "cuts": 0,
        "error": 1.0,
    }
    fine_row = {**missed_row, "predicted_e2e_trace_s": measured, "error": 0.0}
    result = repeats({"rows": [missed_row, fine_row]}, str(tmp_path / "again"), times=1, jobs=2, say=said.append)
    assert result["missed"] == 1 and result["runs"] == 1
    (row,) = result["rows"]
    (again_dir,) = row["again_dirs"]
    again_report = json.loads((Path(again_dir) / RUN_RECORD).read_text())["report"]
    assert again_report["all_correct"] and again_report["completion_rate"] == 1.0
    assert row["real_e2e_trace_s"][0] == measured and row["real_e2e_trace_s"][1] is not None
    assert row["within_one"] is False  # twice the time of either run


def test_a_run_is_kept_only_with_the_same_configuration(tmp_path):
    from dataclasses import replace

    from hil.campaign import RUN_RECORD, _keep_run, kept_run

    cfg = BenchConfig(trace="demo", model="m", out_dir=str(tmp_path / "run"), workload=default_workload(1, 12))
    assert kept_run(cfg) is None  # nothing finished yet
    report = _report("orbitweaver", "demo", [True, False])
    _keep_run(cfg, report)
    assert kept_run(cfg) == report
    assert kept_run(replace(cfg, pace_ms=123.0)) is None  # another run's settings: it runs
    assert kept_run(replace(cfg, workload=default_workload(1, 13))) is None
    (tmp_path / "run" / RUN_RECORD).write_text("{ cut short")
    assert kept_run(cfg) is None  # a damaged record is no result: the run runs again


def _report(policy, trace, completed: list[bool], e2e=100.0):
    from hil.testbench import BenchReport, RequestReport

    requests = [
        RequestReport(
            f"r{i}",
            "p",
            [],
            done,
            True if done else None,
            e2e if done else None,
            e2e if done else None,
            1,
            [],
            [],
            None,
            5 if done else 0,
        )
        for i, done in enumerate(completed)
    ]
    return BenchReport(
        trace,
        policy,
        0.1,
        100.0,
        1.0,
        requests,
        3,
        2,
        2**20,
        1.0,
        10.0,
        sum(completed) / len(completed),
        all(completed) and bool(completed),
    )


def test_report_says_when_a_policy_completes_nothing_and_forms_no_ratio_then(tmp_path):
    from hil.campaign import CampaignCell, load_cells, speedups, summarise, write_report

    cells = [
        CampaignCell("trace-a", "orbitweaver (fixed)", 0, _report("orbitweaver", "trace-a", [True, True], 900.0)),
        CampaignCell("trace-a", "sonic-layer", 0, _report("sonic-layer", "trace-a", [False, False])),
        CampaignCell("trace-a", "hcache", 0, _report("hcache", "trace-a", [True, False], 2000.0)),
        CampaignCell("trace-b", "orbitweaver (fixed)", 0, _report("orbitweaver", "trace-b", [True, True], 300.0)),
        CampaignCell("trace-b", "sonic-layer", 0, _report("sonic-layer", "trace-b", [True, True], 600.0)),
    ]
    rows = summarise(cells)
    ratios = {(r["trace"], r["policy"]): r for r in speedups(rows, "orbitweaver (fixed)")}
    assert ratios[("trace-b", "sonic-layer")]["ratio"] == 2.0
    assert ratios[("trace-a", "sonic-layer")]["ratio"] is None and ratios[("trace-a", "hcache")]["ratio"] is None
    report = write_report(tmp_path, cells).read_text()
    assert "**none completed** (0/2)" in report and "1/2 (50%)" in report
    assert "The claim holds here" in report
    again = write_report(tmp_path / "again", load_cells(tmp_path)).read_text()
    assert again == report.replace(str(tmp_path), str(tmp_path / "again"))


def test_a_result_whose_completed_report_was_missed_counts_as_not_completed(tmp_path):
    """The result came back (and is checked) but the COMPLETED report was never seen, so the
    request has no end-to-end time: it is reported as not completed, and its run forms no
    makespan, instead of stopping the summary."""
    from dataclasses import replace

    from hil.campaign import CampaignCell, speedups, summarise, write_report

    missed = _report("sonic-layer", "trace-b", [True, True], 600.0)
    missed.requests[1] = replace(missed.requests[1], e2e_s=None, e2e_trace_s=None)
    cells = [
        CampaignCell("trace-b", "orbitweaver (fixed)", 0, _report("orbitweaver", "trace-b", [True, True], 300.0)),
        CampaignCell("trace-b", "sonic-layer", 0, missed),
    ]
    rows = {r["policy"]: r for r in summarise(cells)}
    row = rows["sonic-layer"]
    assert (row["completed"], row["requests"], row["runs_all_completed"]) == (1, 2, 0)
    assert row["makespan_trace_s"] is None and row["e2e_mean_trace_s"] == 600.0
    assert row["bitwise"] is True  # the output that came back was still checked
    (ratio,) = speedups(list(rows.values()), "orbitweaver (fixed)")
    assert ratio["ratio"] is None and "completed 1/2" in ratio["why_not"]
    report = write_report(tmp_path, cells).read_text()
    assert "| trace-b | paper | sonic-layer | 0 | 1/2 |" in report


def test_every_run_names_the_cadence_it_flies(tmp_path, model_dirs):
    """A run that names no cadence flies its policy's default; the payload's command line names
    the one resolved either way, and a campaign names orbitweaver's in every label."""
    from hil.campaign import variants
    from hil.testbench import Testbench

    for policy, cadence, flown in (
        ("orbitweaver", None, "adaptive"),
        ("orbitweaver", "fixed", "fixed"),
        ("orbitweaver", "adaptive", "adaptive"),
        ("hcache", None, "fixed"),
    ):
        cfg = BenchConfig(trace="demo", model="unused", out_dir=str(tmp_path), policy=policy, cadence=cadence)
        bench = Testbench(cfg, say=lambda line: None)
        bench.pace_ms = 100.0  # what the run's preparation sets from the references
        args = bench._flight_args()
        assert args.count("--cadence") == 1 and args[args.index("--cadence") + 1] == flown, (policy, cadence)
    # target-emulated storage: the payload's own data is charged at the small model's weight
    from hil.testbench import target_data_weight, target_storage_mbps

    cfg = BenchConfig(
        trace="demo", model=model_dirs["qwen3-vl"], out_dir=str(tmp_path), emulate_target_storage=True, chunk=16
    )
    bench = Testbench(cfg, say=lambda line: None)
    bench.pace_ms = 100.0
    args = bench._flight_args()
    read, write = target_storage_mbps(cfg.model, cfg.chunk, 100.0)
    weight = float(args[args.index("--emulate-data-weight") + 1])
    assert float(args[args.index("--emulate-write-mbps") + 1]) == pytest.approx(write, rel=1e-5)
    assert weight == pytest.approx(target_data_weight(cfg.model), rel=1e-5) and 0 < weight < 1
    assert variants(["orbitweaver", "hcache", "none"], ["fixed", "adaptive"]) == [
        ("orbitweaver (fixed)", "orbitweaver", "fixed"),
        ("orbitweaver (adaptive)", "orbitweaver", "adaptive"),
        ("hcache", "hcache", "fixed"),
        ("none", "none", "fixed"),
    ]


def test_a_run_never_starts_on_top_of_an_earlier_one(tmp_path, capsys):
    """`ow hil run --out DIR` where DIR holds an earlier run: refused with a usage error before
    anything is written, and the earlier run is left as it was."""
    from common.cli import main
    from hil.testbench import EarlierRunError, Testbench

    out = tmp_path / "run"
    (out / "bus").mkdir(parents=True)
    (out / "bus" / "bus-log.jsonl").write_text("an earlier run's log\n")
    with pytest.raises(EarlierRunError, match="holds an earlier run"):
        Testbench(BenchConfig(trace="demo", model="unused", out_dir=str(out))).run()
    code = main(["hil", "run", "--trace", "demo", "--policy", "orbitweaver", "--requests", "1", "--out", str(out)])
    assert code == 2 and "holds an earlier run" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == ["bus", "bus-log.jsonl"]
    assert (out / "bus" / "bus-log.jsonl").read_text() == "an earlier run's log\n"


def test_the_data_weight_is_the_kv_per_token_ratio_to_the_target(tmp_path):
    """A checkpoint byte of the small model stands for kv(2B) / kv(here) target bytes per token
    and layer; the payload's own data is charged that much less per byte."""
    from hil.testbench import target_data_weight

    config = {
        "text_config": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "bfloat16"}
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    here = 2 * 2 * 64 * 2  # K and V, two heads of 64, bf16
    target = 2 * 8 * 128 * 2  # Qwen3-VL-2B: 8 KV heads of 128 (112 KiB per token over 28 layers)
    assert target_data_weight(str(tmp_path)) == pytest.approx(here / target)


def test_run_slots_hand_out_by_rank_and_never_more_than_jobs():
    """Runs waiting for a slot get it lowest rank first, whatever order they asked in, and no
    more than `jobs` hold one at a time (make bench's two end-to-end parts share one pool)."""
    import threading
    import time

    from hil.campaign import RunSlots

    slots = RunSlots(2)
    slots.acquire((0,))
    slots.acquire((0,))  # both slots held: everyone below waits
    got, holding, most = [], [0], [0]
    guard = threading.Lock()

    def run(rank):
        slots.acquire(rank)
        with guard:
            got.append(rank)
            holding[0] += 1
            most[0] = max(most[0], holding[0])
        time.sleep(0.01)
        with guard:
            holding[0] -= 1
        slots.release()

    ranks = [(3, 0), (1, -4), (2, 0), (1, -2), (0, 9)]
    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HANG_S
    while len(slots._waiting) < len(ranks):  # every one of them is waiting
        assert time.monotonic() < deadline, "the runs never all waited"
        time.sleep(0.005)
    slots.release()  # one slot: handed out strictly in rank order
    for t in threads:
        t.join(HANG_S)
    slots.release()
    assert got == sorted(ranks)
    assert most[0] == 1  # the main thread kept the other slot


def test_run_slots_refuse_no_slot():
    from hil.campaign import RunSlots

    with pytest.raises(ValueError, match="at least one run slot"):
        RunSlots(0)
