"""Recovery: plans that rebuild prefill state after a reboot, their executor, the cost model
and the optimal planner (docs/recovery.md).

Importing the package registers every planner: plan.py defines the problem and the simple
planners, optimal.py (which builds on plan.py and cost.py) adds "optimal"."""

from . import (
    optimal,  # noqa: F401  (registers "optimal")
    plan,  # noqa: F401
)
