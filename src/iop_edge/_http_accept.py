"""The listener's accept loop: :mod:`iop_io.accept`, shared with the mock backend (kept importable here)."""

from iop_io.accept import ACCEPT_BATCH, Handler, accept_loop, accept_waiting

__all__ = ["ACCEPT_BATCH", "Handler", "accept_loop", "accept_waiting"]
