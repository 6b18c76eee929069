"""How many examples each hypothesis test draws, by profile (conftest registers and loads them).

A test names the examples it draws in the thorough profile (`--full`, .ci/run); the fast tier
(README's test command, hypothesis' `fast` profile) draws a tenth of that, at least
MIN_EXAMPLES: the same properties, found with fewer examples. `--hypothesis-profile NAME`
chooses a profile explicitly."""

from __future__ import annotations

from hypothesis import settings

THOROUGH_EXAMPLES = 1000
FAST_EXAMPLES = 100
MIN_EXAMPLES = 10


def examples(thorough: int) -> int:
    """`thorough` examples under the thorough profile, scaled by the loaded profile's budget
    otherwise (read when the test module is imported, after conftest loaded the profile)."""
    scale = settings().max_examples / THOROUGH_EXAMPLES
    return thorough if scale >= 1 else max(MIN_EXAMPLES, round(thorough * scale))
