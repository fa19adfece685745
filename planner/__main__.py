"""``python -m planner``: the same as the ``planner`` command (see :mod:`planner.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
