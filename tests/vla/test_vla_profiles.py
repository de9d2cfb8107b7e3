"""Profile tables: shipped GPU profiles (assumptions in the file) and live CPU profiling."""

import json

import pytest

from common.vla import analytic, sim
from common.vla.profiles import PROFILE_DIR, ProfileTable, load_profile, shipped_profiles
from common.vla.scheduler import LockstepScheduler


def test_shipped_profiles_cover_the_paper_server_class():
    assert {"rtx-pro-6000x4", "h100x4"} <= set(shipped_profiles())
    for name in ("rtx-pro-6000x4", "h100x4"):
        p = load_profile(name)
        assert p.device["count"] == 4 and p.backend == "analytic-gpu"
        assert len(p.assumptions) >= 8 and any("SLO" in a for a in p.assumptions)
        keys = {(e.vlm_arch, e.vlm_batch, e.adit_arch, e.adit_batch, e.vlm_share) for e in p.locksteps}
        assert len(keys) == len(p.archs) ** 2 * len(p.batch_sizes) ** 2 * len(p.vlm_shares)
        for e in p.locksteps:  # co-running never beats the slower stage running alone
            assert e.lockstep_ms >= max(e.vlm_ms, e.adit_ms) - 1e-9
            assert e.lockstep_ms >= min(p.vlm_alone(e.vlm_arch, e.vlm_batch), p.adit_alone(e.adit_arch, e.adit_batch))


def test_shipped_files_are_what_the_derivation_gives():
    for key in analytic.GPUS:
        derived = analytic.derive_profile(key).to_json()
        shipped = json.loads((PROFILE_DIR / f"{key}x4.json").read_text())
        assert shipped == json.loads(json.dumps(derived))


def test_analytic_model_reproduces_the_public_pi0_breakdown():
    for row in analytic.calibration():
        assert 0.85 <= row["ratio"] <= 1.15, row


def test_concurrency_is_worth_it_for_pi0_on_the_reference_gpu():
    p = load_profile("rtx-pro-6000x4")
    best = p.lockstep("pi0", 1, "pi0", 1)
    assert best.lockstep_ms < p.vlm_alone("pi0", 1) + p.adit_alone("pi0", 1)


def test_round_trip_and_format_check(tmp_path):
    p = load_profile("h100x4")
    path = p.save(tmp_path / "copy.json")
    q = load_profile(path)
    assert q.to_json() == p.to_json()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError):
        load_profile(bad)
    with pytest.raises(FileNotFoundError):
        load_profile("no-such-profile")


def test_cpu_profile_is_measured_in_the_same_format_and_drives_the_simulator(tmp_path):
    from common.vla.profiler import measure_cpu_profile

    prof = measure_cpu_profile(["smolvla"], batch_sizes=(1, 2), threads=2, repeats=1)
    assert prof.backend == "cpu" and prof.vlm_shares == (0.5,)
    assert all(t > 0 for t in prof.arch("smolvla").vlm_ms.values())
    assert len(prof.locksteps) == 4
    loaded = load_profile(prof.save(tmp_path / "cpu.json"))
    assert isinstance(loaded, ProfileTable) and loaded.slo_ms("smolvla") == pytest.approx(prof.slo_ms("smolvla"), 1e-3)
    r = sim.simulate(sim.robion(max_batch=2), sim.Workload({"smolvla": 2}, epochs=1, duration_s=3.0), loaded)
    assert r.requests > 0
    s = LockstepScheduler({"smolvla": "smolvla"}, max_batch=2, profile=loaded)
    assert s.batch_sizes == (1, 2)
