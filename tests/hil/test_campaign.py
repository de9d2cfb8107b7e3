"""A short campaign (2 traces x 2 policies) end to end with real processes, and its report. The
payloads are forked from the bus's zygote with an emulated boot (hil/zygote.py): every output is
still checked bit for bit against its uninterrupted reference."""
import json

import pytest

from hil.campaign import run_campaign
from hil.testbench import BenchConfig, default_workload


def _short_trace(path):
    """One early FDIR cut, then a long window. The cut lands before the request can end: the
    emulated boot (1 s) plus the request's paced units (over 40 x 80 ms) take longer than 3 s."""
    import traces
    from traces.model import CutCause, PowerWindow

    traces.dump(traces.Trace.from_windows("short", 60, [PowerWindow(0, 3.0, CutCause.FDIR, 0.0),
                                                        PowerWindow(4.5, 60, None, 0.0)],
                                          reference_request_s=10, description="test trace",
                                          source={"kind": "manual"}, assumptions=["for the campaign test"]), path)
    return str(path)


@pytest.mark.slow
def test_short_campaign_end_to_end(model_dirs, tmp_path):
    base = BenchConfig(trace="demo", model=model_dirs["qwen3-vl"], out_dir=str(tmp_path / "campaign"), requests=1,
                       workload=default_workload(1, 12), time_scale=1.0, pace_ms=80, boot_trace_s=1.0)
    short = _short_trace(tmp_path / "short.jsonl")
    cells = run_campaign(base, [short, "demo"], ["orbitweaver", "none"], [0], say=lambda s: None, jobs=2)
    assert len(cells) == 4
    for cell in cells:
        r = cell.report
        assert r.power_cycles >= 1
        done = [q for q in r.requests if q.completed]
        assert all(q.correct for q in done)
    # orbitweaver finishes its request on both traces
    assert all(c.report.completion_rate == 1.0 for c in cells if c.policy == "orbitweaver")
    report = (tmp_path / "campaign" / "report.md").read_text()
    assert "| demo | paper | orbitweaver |" in report and "| short | paper | none |" in report
    assert "| paper | demo | 1/1 (100%)" in report  # the summary: orbitweaver's completion first
    for png in ("e2e.png", "completion.png", "bytes.png"):
        assert (tmp_path / "campaign" / png).stat().st_size > 1000
    rows = json.loads((tmp_path / "campaign" / "campaign.json").read_text())["rows"]
    assert {(r["trace"], r["policy"]) for r in rows} == {(t, p) for t in (short, "demo") for p in ("orbitweaver", "none")}
    # the cut in the short trace lands inside the request: orbitweaver resumes, none starts over
    by_policy = {c.policy: c.report for c in cells if c.trace == short}
    assert by_policy["orbitweaver"].cuts_total >= 1
