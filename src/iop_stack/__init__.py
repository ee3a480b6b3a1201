"""iop_stack: ``iop-stack``, the whole system on one machine for trying it out (``make run``).

Starts ``iop-mock-backend``, ``iop-edge`` and ``iop-node`` as separate
processes on loopback with the example configs shipped in
``iop_stack/examples/`` (or the files given on the command line), prints a
request to try, and stops all three on Ctrl-C or SIGTERM. It is a launcher
only: it imports nothing from the Edge but its config loader, and holds no
state of the system.
"""

from ._stack import main

__all__ = ["main"]
