"""``python -m gce_watchdog``: the same as the ``gce-watchdog`` console script."""

from gce_watchdog.cli import main

raise SystemExit(main())
