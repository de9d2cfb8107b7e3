"""Stop after every unit of work (vision block, prefill block, decode step) and after every
checkpoint commit, throw away all in-memory state (a fresh model load, a fresh engine), resume:
the tokens and the final logits are bitwise those of the uninterrupted run."""

import shutil

import pytest
import torch
from testkit import ARCHS, MAX_NEW, CutAfter, engine, inputs_for, run_to_completion

from flight.engine import SimulatedCut
from flight.model.loader import load_model


def _uninterrupted(model_dir, tmp_path, policy="orbitweaver"):
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    units = CutAfter(10**9)
    commits = CutAfter(10**9)
    result = engine(model, policy=policy, events=units.event, after_commit=commits.commit).run(
        inputs, str(tmp_path / "ref"), MAX_NEW
    )
    return inputs, result, units.seen, commits.seen


def _cut_then_resume(model_dir, inputs, ckpt, cut: CutAfter, hook: str, policy="orbitweaver"):
    model = load_model(model_dir, device="cpu")
    kw = {"events": cut.event} if hook == "event" else {"after_commit": cut.commit}
    with pytest.raises(SimulatedCut):
        engine(model, policy=policy, **kw).run(inputs, str(ckpt), MAX_NEW)
    return run_to_completion(model_dir, inputs, ckpt, policy=policy)


@pytest.mark.parametrize(
    "arch,policy",
    [(a, "orbitweaver") for a in ARCHS] + [("qwen3-vl", p) for p in ("sonic-layer", "sonic-chunk", "hcache")],
)
def test_stop_after_every_unit_and_every_commit(model_dirs, tmp_path, arch, policy):
    inputs, ref, n_units, n_commits = _uninterrupted(model_dirs[arch], tmp_path, policy)
    assert n_units >= 4 + 4 + (MAX_NEW - 1)  # vision blocks + prefill blocks (>= one per chunk) + decode steps
    assert n_commits >= 4
    phases_resumed = set()
    for hook, total in (("event", n_units), ("commit", n_commits)):
        for n in range(1, total + 1):
            ckpt = tmp_path / f"{hook}-{n}"
            cut = CutAfter(n)
            resumed = _cut_then_resume(model_dirs[arch], inputs, ckpt, cut, hook, policy)
            assert resumed.token_ids == ref.token_ids, f"{hook} cut #{n} after {cut.last}"
            assert torch.equal(resumed.logits, ref.logits), f"{hook} cut #{n} after {cut.last}"
            phases_resumed.add(resumed.resumed_from["phase"])
            shutil.rmtree(ckpt)
    # hcache keeps no intermediate vision state, and writes decode records per 64-token storage
    # chunk: with MAX_NEW tokens, none (a cut in decode resumes from prefill's records)
    expected = {"start", "prefill"} | ({"vision", "decode"} if policy != "hcache" else set())
    assert expected <= phases_resumed


def test_many_cuts_in_a_row_on_one_directory(model_dirs, tmp_path):
    """Each process lifetime gets three units of work done, then the power goes (a window just
    longer than one decode record, D = 2): a dozen cuts, each resuming where the last left off."""
    arch = "qwen3-vl"
    inputs, ref, n_units, _ = _uninterrupted(model_dirs[arch], tmp_path)
    ckpt = tmp_path / "ck"
    cuts = 0
    while True:
        model = load_model(model_dirs[arch], device="cpu")
        try:
            result = engine(model, events=CutAfter(3).event).run(inputs, str(ckpt), MAX_NEW)
            break
        except SimulatedCut:
            cuts += 1
            assert cuts < 3 * n_units, "no progress across cuts"
    assert cuts >= n_units // 3
    assert result.token_ids == ref.token_ids and torch.equal(result.logits, ref.logits)


@pytest.mark.parametrize("policy", ["orbitweaver", "hcache+"])
def test_every_planner_resumes_bitwise_from_every_prefill_cut(model_dirs, tmp_path, policy):
    arch = "qwen3-vl"
    inputs, ref, _, _ = _uninterrupted(model_dirs[arch], tmp_path, policy)
    vision_units = 4
    prefill_units = 16 if policy == "hcache+" else 8
    for planner in ("chunk-first", "layer-first", "optimal"):
        for n in range(vision_units + 1, vision_units + prefill_units + 1):
            ckpt = tmp_path / f"{planner}-{n}"
            with pytest.raises(SimulatedCut):
                engine(load_model(model_dirs[arch], device="cpu"), policy=policy, events=CutAfter(n).event).run(
                    inputs, str(ckpt), MAX_NEW
                )
            resumed = run_to_completion(model_dirs[arch], inputs, ckpt, policy=policy, planner=planner)
            assert resumed.resumed_from["phase"] == "prefill"
            assert resumed.plan["planner"] == planner
            assert resumed.token_ids == ref.token_ids and torch.equal(resumed.logits, ref.logits), (planner, n)
            shutil.rmtree(ckpt)
