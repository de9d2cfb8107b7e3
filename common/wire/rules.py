"""The input rules of a task's fields, each written once and applied at every boundary that
takes the field: the wire's UPLINK_TASK (common/wire/messages.py), the ground's uplink before
anything is sent (ground/images.py), `ow infer` (flight/cli.py) and the payload's input building
for prompts that did not come over the wire (flight/model/inputs.py).

A rule says what is wrong -- the response code the payload answers with, the field, and one line
saying why -- or None; each boundary raises its own kind of error from it (a WireError, a
CLI error, an InputError), so the rule and its words are the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.wire.ids import ResponseCode
from common.wire.text import is_blank


@dataclass(frozen=True)
class Broken:
    """A rule an input breaks."""

    code: ResponseCode
    field: str
    reason: str  # one line, the code's description


def prompt_rule(prompt: str) -> Broken | None:
    """A prompt must have a visible character (`is_blank`): EMPTY_PROMPT otherwise."""
    if is_blank(prompt):
        return Broken(ResponseCode.EMPTY_PROMPT, "prompt", ResponseCode.EMPTY_PROMPT.description)
    return None


__all__ = ["Broken", "prompt_rule"]
