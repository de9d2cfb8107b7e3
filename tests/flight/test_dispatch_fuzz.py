"""Fuzzed frames straight into the payload's dispatch (the red team sent 30,000): each one a
telecommand or undecodable gets exactly one ACCEPTED or REJECTED, telemetry none, nothing escapes
handle_packet and no handler faults. `python -m bench.redteam` runs it with 1,000,000 frames."""

from hil.redteam import fuzz_dispatch


def test_every_fuzzed_frame_gets_exactly_one_verdict(tmp_path):
    report = fuzz_dispatch(1500, seed=9, workdir=str(tmp_path))
    assert report.passed, (report.verdict_violations[:5], report.escaped[:5], report.command_faults)
    assert report.accepted > 50 and len(report.rejected) > 10  # the frames reach deep, not only the CRC
