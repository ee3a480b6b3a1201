"""Node tests: the harness is ``node.harness``."""
