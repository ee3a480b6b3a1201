"""``python -m benchmarks.scale``: see :mod:`benchmarks.scale.driver`."""

import sys

from .driver import entry

entry(sys.argv[1:])
