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


def test_a_table_the_gpu_check_records_on_cpu_drives_ow_vla_bench(tmp_path, capsys):
    """bench/gpu_check.py's VLA stage, the code a lent GPU runs, on the CPU backend: it writes a
    measured lockstep table (both architectures, cross-model pairs, provenance) that loads and
    runs `ow vla bench --profile FILE` on a tiny setting."""
    from bench.gpu_check import vla
    from common.cli import main

    path = tmp_path / "vla_profile.json"
    summary = vla("cpu", ("pi0", "smolvla"), (1, 2), 1, (0.5,), out=path)
    assert summary["backend"] == "cpu" and summary["table"] == str(path)
    table = load_profile(path)
    assert table.backend == "cpu" and table.provenance["tool"] == "bench/gpu_check.py"
    assert table.provenance["statistic"] == "median" and table.provenance["repeats"] == 1
    # every (VLM arch, batch, ADiT arch, batch) at the one share: cross-model pairs included
    assert {(e.vlm_arch, e.adit_arch) for e in table.locksteps} == {
        ("pi0", "pi0"),
        ("pi0", "smolvla"),
        ("smolvla", "pi0"),
        ("smolvla", "smolvla"),
    }
    assert len(table.locksteps) == 16 and all(e.lockstep_ms > 0 for e in table.locksteps)

    report = tmp_path / "bench.json"
    argv = ["--profile", str(path), "--quick", "--experiments", "single", "--seeds", "0", "--slo-factors", "3"]
    argv += ["--epochs", "2", "--duration", "4"]
    code = main(["vla", "bench", *argv, "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0 and "measured-cpu (cpu; 1 x CPU)" in out
    single = json.loads(report.read_text())["single"]
    assert set(single["best_max_batch"]) == {"pi0", "smolvla"}  # max batch from the table's sizes (1, 2)
    assert set(single["best_max_batch"].values()) <= {1, 2}


def _broken(doc, how):
    doc = json.loads(json.dumps(doc))
    how(doc)
    return doc


BROKEN = [  # (what is wrong, how, the loader's message)
    ("a pair's rows missing", lambda d: d.__setitem__("locksteps", d["locksteps"][:-6]), "no lockstep row for VLM"),
    ("a negative time", lambda d: d["locksteps"][0].__setitem__(7, -1.0), "locksteps[0].lockstep_ms must be"),
    ("a batch size without a time", lambda d: d["archs"]["pi0"]["vlm_ms"].pop("2"), "archs.pi0.vlm_ms[2]"),
    ("a measured table without provenance", lambda d: d.__setitem__("backend", "cuda"), "needs its provenance"),
    ("an unknown architecture", lambda d: d["locksteps"][0].__setitem__(0, "gr00t"), "architecture not in archs"),
    ("a share off the list", lambda d: d["locksteps"][0].__setitem__(4, 0.3), "share 0.3 not in vlm_shares"),
    ("no archs", lambda d: d.pop("archs"), "profile lacks archs"),
]


@pytest.mark.parametrize("what,how,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_malformed_table_is_refused_with_its_fault_named(tmp_path, capsys, what, how, message):
    from common.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(load_profile("h100x4").to_json(), how)))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_profile(bad)
    code = main(["vla", "bench", "--profile", str(bad), "--quick", "--experiments", "single"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "cannot load profile" in err and message in err and str(bad) in err


def test_a_file_that_is_not_json_is_refused(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text('{"format": "orbitweaver.vla.profile/1", "locks')
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(bad)
