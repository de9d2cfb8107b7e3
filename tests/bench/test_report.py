"""`make bench`: the completion table of the real-process Figure 10 campaign, and its options."""

from __future__ import annotations

import pytest

from bench.run_all import _completion_table


def _row(policy, completed, seed=0, trace="trace-a", workload="paper", correct=True):
    return {
        "trace": trace,
        "workload": workload,
        "seed": seed,
        "policy": policy,
        "completed": completed,
        "requests": 2,
        "correct": correct,
    }


def test_completion_table_counts_requests_over_seeds_and_says_when_none_complete():
    rows = [
        _row("orbitweaver", 1.0),
        _row("orbitweaver", 0.5, seed=1),
        _row("orbitweaver (adaptive)", 1.0),
        _row("orbitweaver (adaptive)", 1.0, seed=1),
        _row("hcache", 0.0),
        _row("hcache", 0.0, seed=1),
        _row("sonic-layer", 1.0, trace="trace-b", correct=False),
    ]
    lines = _completion_table(rows)
    header = next(line for line in lines if line.startswith("| workload"))
    # OrbitWeaver first, its fixed cadence named as such, then the baselines
    assert header == "| workload | trace | orbitweaver (fixed) | orbitweaver (adaptive) | hcache | sonic-layer |"
    assert "| paper | trace-a | 3/4 | 4/4 | **none** | - |" in lines
    assert "| paper | trace-b | - | - | - | 2/2 (1 runs not bitwise) |" in lines
    assert "| all | all | 3/4 (75%) | 4/4 (100%) | 0/4 (0%) | 2/2 (100%) |" in lines


def test_requests_a_wall_clock_limit_left_unfinished_are_marked_as_stopped_early():
    stopped = {**_row("orbitweaver", 0.5, seed=1), "stopped_trace_s": 4950.0, "stopped_early": 1}
    finished_first = {**_row("orbitweaver", 1.0), "stopped_trace_s": 4000.0, "stopped_early": 0}  # all done
    lines = _completion_table([finished_first, stopped, _row("hcache", 0.0)])
    assert "| paper | trace-a | 3/4 (1 stopped early) | **none** |" in lines
    note = next(line for line in lines if line.startswith('"Stopped early"'))
    assert "(1 runs, at 4950-4950 trace s)" in note


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--traces", "sat1-like,no-such-trace"], "--traces: no-such-trace"),
        (["--parts", "e2e,fig99"], "unknown part(s): fig99"),
    ],
)
def test_make_bench_rejects_bad_options_before_measuring_anything(argv, says, tmp_path, capsys):
    from bench.run_all import main

    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--out", str(tmp_path / "report")])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "report").exists()  # nothing measured, nothing written


def test_a_miss_is_a_prediction_beyond_10_percent_or_a_completion_on_one_side_only():
    from bench.report import beyond

    row = {"comparable": True, "predicted_completed": True, "e2e_trace_s": 100.0, "error": 0.099}
    assert not beyond(row)
    assert beyond({**row, "error": -0.101})
    assert beyond({**row, "e2e_trace_s": None, "error": None})  # only the simulation completes
    assert beyond({**row, "predicted_completed": False, "error": None})  # only the run completes
    assert not beyond({**row, "comparable": False, "error": 0.5})  # the bench lost the request


def test_the_report_puts_each_missed_request_beside_every_real_run_of_it():
    from bench.report import repeat_lines

    rows = [
        {
            "run_dir": "runs/sat1-like-paper-s1-hcache+",
            "request": 0,
            "policy": "hcache+",
            "cadence": "fixed",
            "predicted_e2e_trace_s": 432.0,
            "predicted_cuts": 4,
            "real_e2e_trace_s": [495.0, 433.0, None],
            "real_cuts": [5, 4, 9],
            "real_spread": None,
            "real_disagree": True,
            "within_one": True,
        }
    ]
    d = {
        "validation": {"rows": []},
        "repeats": {
            "times": 2,
            "missed": 1,
            "within_one": 1,
            "runs": 1,
            "testbench_beyond_10_percent": 1,
            "rows": rows,
        },
    }
    text = "\n".join(repeat_lines(d))
    assert "1 are predicted within 10 % of at least one real run" in text
    assert "in **1 the real runs themselves differ by more than 10 %**" in text
    assert "| sat1-like-paper-s1-hcache+ | 0 | hcache+ | 432 (4) | 495 (5), 433 (4), not completed (9) |" in text
    assert "completes in some runs only | yes |" in text
    assert repeat_lines({"validation": {"rows": []}, "repeats": {"missed": 0}})[0].startswith("No request")
    assert repeat_lines({"repeats": {"missed": 0}}) == []  # no validation: no section


def _val_row(trace, policy, error, completed=True, predicted=True):
    return {
        "trace": trace,
        "policy": policy,
        "comparable": True,
        "e2e_trace_s": 100.0 if completed else None,
        "predicted_completed": predicted,
        "error": error if completed and predicted else None,
    }


def test_the_validation_says_per_trace_where_every_request_of_the_four_policies_is_within_10_percent():
    from bench.report import by_trace_lines, validation_by_trace

    policies = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache")
    rows = [_val_row(t, p, 0.01) for t in ("trace-b", "/c/traces/trace-b-seed1.jsonl") for p in policies]
    rows += [_val_row("sat2-like", p, -0.02) for p in policies]
    rows += [_val_row("sat1-like", p, 0.0) for p in policies] + [_val_row("sat1-like", "hcache+", 0.21)]
    rows += [_val_row("trace-a", p, 0.0) for p in policies[:3]]  # hcache never measured there
    rows += [_val_row("dellingr-like", p, 0.0) for p in policies]
    rows += [_val_row("dellingr-like", "hcache", None, completed=False)]  # only the simulation completes
    by = {r["trace"]: r for r in validation_by_trace({"rows": rows})}
    assert by["trace-b"]["compared"] == 8 and by["trace-b"]["paper_policies_within"]  # both seeds, one kind
    assert by["sat2-like"]["paper_policies_within"]
    # a strengthened variant's miss is counted, but the paper's four are all within
    assert by["sat1-like"]["missed_by_policy"] == {"hcache+": 1} and by["sat1-like"]["paper_policies_within"]
    assert not by["trace-a"]["paper_policies_within"]  # a policy with no request compared
    assert by["dellingr-like"]["missed_by_policy"] == {"hcache": 1} and not by["dellingr-like"]["paper_policies_within"]
    text = "\n".join(by_trace_lines({"rows": rows}))
    assert "on **3 trace(s)** every request" in text and "(sat1-like, sat2-like, trace-b)" in text and "(met)" in text
    assert "| sat1-like | 5 | 4 | 21.0 % | hcache+ 1 |" in text
    few = [r for r in rows if r["trace"] == "sat2-like"]
    assert "(NOT met)" in "\n".join(by_trace_lines({"rows": few}))


def test_the_summary_counts_the_requests_within_10_percent_and_names_the_traces_that_meet_the_bar():
    from bench.report import summary_lines

    policies = ("orbitweaver", "sonic-layer", "sonic-chunk", "hcache")
    rows = [_val_row(t, p, 0.01) for t in ("trace-b", "sat2-like") for p in policies]
    rows += [_val_row("sat1-like", "hcache", 0.2)]
    (row,) = [
        line for line in summary_lines({"validation": {"rows": rows, "max_abs_error": 0.2}}) if "simulator" in line
    ]
    assert "8 of 9 requests within 10 %, largest error 20.0 %" in row
    assert "within 10 % on 2 traces (sat2-like, trace-b)" in row


def test_the_planner_row_gives_the_slowest_frontier_the_product_plans_not_the_reference_full_dp():
    from bench.report import summary_lines

    def timing(frontier, warm, median, cold, case="36 layers (4B/8B), G=2", groups=18):
        return {
            "case": case,
            "frontier": frontier,
            "groups": groups,
            "warm_ms": warm,
            "warm_median_ms": median,
            "cold_ms": cold,
        }

    planner = {
        "planner_time": [
            timing("staircase", 1.6, 1.7, 3.0),
            timing("random-stair", 3.4, 3.9, 5.3),
            timing("random", 2.6, 8.2, 3.3),
            timing("random, full DP", 32.4, 44.8, 69.4),
            timing("random", 9.0, 12.0, 30.0, case="28 layers (2B), G=2", groups=14),
        ]
    }
    (row,) = [line for line in summary_lines({"planner": planner}) if "optimal planner" in line]
    assert "1.6 ms warm (best of 9; median 1.7 ms), 3.0 ms cold" in row
    assert "slowest over the 3 frontiers (median or cold) 8.2 ms" in row
