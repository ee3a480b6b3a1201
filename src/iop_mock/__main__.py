"""``python -m iop_mock``: the same as ``iop-mock-backend``."""

from .backend import main

if __name__ == "__main__":
    main()
