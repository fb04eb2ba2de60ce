"""``gce-watchdog validate``: prove the recovery chain on the user's own project.

See docs/validate.md."""
