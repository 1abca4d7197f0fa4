"""The suite's two tiers, chosen by GRAPHCAP_TEST_TIER (tests/conftest.py applies them):
- ci (the default; `make test`): every test not marked `thorough`, hypothesis at the `ci` profile's examples;
- thorough (`make test-thorough`, scripts/gpu-check.sh tests): every test, hypothesis at each test's own count.
A property test that sets its own count in @settings passes it through `examples`, so that the tier decides."""
from __future__ import annotations

import os

TIERS = ("ci", "thorough")
TIER = os.environ.get("GRAPHCAP_TEST_TIER", "ci")
CI_EXAMPLES = 15  # per property test in the CI tier (the `ci` hypothesis profile)
THOROUGH_EXAMPLES = 100  # per property test in the thorough tier that sets no count of its own


def examples(n: int) -> int:
    """A property test's max_examples: its own `n` in the thorough tier, at most the CI profile's in the CI tier."""
    return n if TIER == "thorough" else min(n, CI_EXAMPLES)


def thorough(*values: object, id: str | None = None) -> object:  # noqa: A002 - pytest.param's own name
    """One parametrize case for the thorough tier only: a heavy variant of what the CI tier's cases already cover."""
    import pytest

    return pytest.param(*values, marks=pytest.mark.thorough, id=id)
