"""The two tiers of the suite (see CONTRIBUTING.md, "Tests and tiers").

``python -m pytest`` is the quick tier: every module and op at smoke sizes, each heavy property at the
small example count its test names. ``python -m pytest --deep`` is the deep tier: the whole suite, tests
marked ``deep`` included, and every property at the Hypothesis profile's count (``ci``: 25;
``HYPOTHESIS_PROFILE=thorough``: 300). ``tests/conftest.py`` sets `DEEP` before any test module is
imported.
"""

from __future__ import annotations

from hypothesis import settings

DEEP = False


def examples(quick: int) -> int:
    """``max_examples`` of a heavy property: ``quick`` in the quick tier, the profile's count in the deep one."""
    return max(quick, settings().max_examples) if DEEP else quick
