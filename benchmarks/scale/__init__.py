"""One Edge at fleet size (``python -m benchmarks.scale``), by role.

``driver`` runs the benchmark and starts the other two as processes: ``fleet`` (the fake
nodes) and ``edge`` (the traced Edge); ``logs`` reads their lines and ``report`` writes the tables.
"""

from .driver import SIZES, edge_yaml, run

__all__ = ["SIZES", "edge_yaml", "run"]
