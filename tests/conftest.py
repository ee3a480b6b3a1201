"""Suite-wide settings: Hypothesis profiles.

``ci`` runs in ``make test``; ``soak`` (``HYPOTHESIS_PROFILE=soak``, ``make soak``)
runs ten times longer. Stateful tests set their own step counts per profile
through :data:`STATEFUL`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "soak",
    max_examples=1_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
