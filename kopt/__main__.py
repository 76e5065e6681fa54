"""``python -m kopt``: the same command line as the ``kopt`` script."""

from kopt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
