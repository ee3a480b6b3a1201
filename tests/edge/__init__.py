"""Edge tests (in process): the harness is ``edge.harness``."""
