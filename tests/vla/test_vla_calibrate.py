"""The derived profile calibrated to the paper's anchor: the fitted SLO factor reproduces it."""

import statistics

from common.vla import calibrate
from common.vla.analytic import SHIPPED, derive_profile

QUICK = calibrate.CalibrationSettings(epochs=5, duration_s=6.0, seeds=(0,))


def test_the_fitted_factor_reproduces_the_anchor_and_the_shipped_one_does_not():
    shipped = statistics.median(calibrate.anchor_robots(derive_profile("rtx-pro-6000"), QUICK))
    assert shipped < calibrate.ANCHOR_ROBOTS  # the shipped deadline under-serves the paper's GPU
    fit = calibrate.fit_slo_factor(SHIPPED, QUICK)
    assert fit.factor <= fit.factor_high and fit.factor > SHIPPED.slo_factor
    assert statistics.median(fit.robots_at_factor) >= calibrate.ANCHOR_ROBOTS
    # the smallest such factor: a little below it the anchor is not reached
    below = derive_profile("rtx-pro-6000", params=SHIPPED.with_(slo_factor=fit.factor - 0.05))
    assert statistics.median(calibrate.anchor_robots(below, QUICK)) < calibrate.ANCHOR_ROBOTS


def test_a_calibration_candidate_says_what_it_was_made_with():
    prof = derive_profile("rtx-pro-6000", params=SHIPPED.with_(kernel_us=8.0, corun_slowdown=0.0, slo_factor=3.4))
    assert prof.name == "rtx-pro-6000x4-calibrated"
    assert prof.device["analytic_params"]["kernel_us"] == 8.0
    assert any("8.0 us per kernel" in line for line in prof.assumptions)
    assert derive_profile("rtx-pro-6000").name == "rtx-pro-6000x4"  # the shipped one is unchanged
