"""Seeded whole-system simulation of the Edge and Nodes under faults (issue 5, part 1).

``python -m tests.sim --seeds N --first-seed S``; ``--ha`` runs the world with
Edge replicas (``_ha.py``: an election, leader step-downs, pauses, etcd
partitions); ``--tenants`` the world with tenants (``_tenants.py``: floods, an
idle tenant returning, token-cost skew). ``tests/sim/test_sim.py`` and
``tests/sim/test_tenants.py`` run the CI seeds. See docs/reliability.md.
"""
