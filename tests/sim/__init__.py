"""Seeded whole-system simulation of the Edge and Nodes under faults (issue 5, part 1).

``python -m tests.sim --seeds N --first-seed S``; ``--ha`` runs the world with
Edge replicas (``_ha.py``: an election, leader step-downs, pauses, etcd
partitions). ``tests/sim/test_sim.py`` runs the CI seeds of both. See
docs/reliability.md.
"""
