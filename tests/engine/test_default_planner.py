"""The product flies its own planner: `ow infer` and `ow flight run` resume with OrbitWeaver's
`optimal` planner unless told otherwise (issue 31, point 6); the baselines keep their own."""

import argparse

import pytest

from flight.checkpoint.policies import get_policy
from flight.cli_options import add_engine_arguments, engine_options
from flight.options import DEFAULT_PLANNER, EngineOptions


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_orbitweaver_resumes_with_its_own_planner_by_default():
    assert DEFAULT_PLANNER == "optimal" and EngineOptions().planner == "optimal"
    assert engine_options(_parsed()).planner == "optimal"
    assert engine_options(_parsed("--planner", "layer-first")).planner == "layer-first"
    assert get_policy("orbitweaver").recovery(engine_options(_parsed()).planner, True) == ("optimal", True)


@pytest.mark.parametrize("policy,planner", [("sonic-layer", "chunk-first"), ("sonic-chunk", "chunk-first")])
def test_the_paper_defined_baselines_keep_their_own_scheduler(policy, planner):
    options = engine_options(_parsed("--policy", policy))
    assert get_policy(policy).recovery(options.planner, True)[0] == planner


def test_a_bad_planner_is_one_line():
    from common.errors import CliError

    with pytest.raises(CliError, match="unknown --planner"):
        engine_options(_parsed("--planner", "fastest"))


def test_the_planner_names_the_command_line_checks_are_those_registered():
    """`--planner` is checked without importing the planners (they load on the inference worker,
    off the thread that answers the bus): the names it accepts must stay those registered."""
    from flight.options import PLANNER_NAMES
    from flight.recovery.plan import PLANNERS

    assert sorted(PLANNER_NAMES) == sorted(PLANNERS)
