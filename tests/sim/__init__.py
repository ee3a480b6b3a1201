"""Seeded whole-system simulation of the Edge and Nodes under faults (issue 5, part 1).

``python -m tests.sim --seeds N --first-seed S``; ``tests/sim/test_sim.py`` runs
the CI seeds. See docs/reliability.md.
"""
