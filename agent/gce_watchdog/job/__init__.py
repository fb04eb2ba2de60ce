"""The job's side: what the agent tells the job started by ``gce-watchdog exec`` (notice.py)."""
