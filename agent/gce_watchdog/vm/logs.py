"""structlog set-up: one key=value line per event on stderr (journald captures it)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def setup(level: str = "info") -> None:
    global _configured
    if _configured:
        return
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "event"], drop_missing=True
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get(name: str = "gce-watchdog") -> Any:
    return structlog.get_logger(name)
