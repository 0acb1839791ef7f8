"""Hypothesis profiles: ``ci``, the full example counts (what ``scripts/test`` runs, and so CI),
and ``dev``, at most DEV_MAX_EXAMPLES per test (``scripts/test --quick`` and targeted runs).

The profile is ``$TURNGUARD_HYPOTHESIS_PROFILE`` (``scripts/test`` sets it), else ``dev``;
``--hypothesis-profile ci`` on the command line wins over both. A test that wants more or fewer
examples than Hypothesis's default asks for ``examples(n)``: n under ``ci``, fewer under ``dev``
(a ``max_examples`` written as a number would override the profile).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "TURNGUARD_HYPOTHESIS_PROFILE"
DEV_MAX_EXAMPLES = 10

# No deadline and no "input generation is slow" check in either: both are timings, and a busy
# machine (CI's, or this suite's own workers beside each other) exceeds them with no defect.
_UNTIMED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings(**_UNTIMED))
settings.register_profile("dev", max_examples=DEV_MAX_EXAMPLES, **_UNTIMED)


def load_from_environment() -> None:
    """Load the profile ``$TURNGUARD_HYPOTHESIS_PROFILE`` names (``dev`` when unset)."""
    settings.load_profile(os.environ.get(PROFILE_ENV) or "dev")


def examples(n: int) -> int:
    """The ``max_examples`` of a test that runs ``n`` examples in the full profile."""
    if settings.get_current_profile_name() == "ci":
        return n
    return min(n, DEV_MAX_EXAMPLES)
