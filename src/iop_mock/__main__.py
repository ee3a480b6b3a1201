"""``python -m iop_mock``: the same as ``iop-mock-backend``."""

from .cli import main

if __name__ == "__main__":
    main()
