from gce_watchdog.cli import main

raise SystemExit(main())
