"""``python -m iop_stack``: the same as ``iop-stack``."""

from ._stack import main

if __name__ == "__main__":
    raise SystemExit(main())
