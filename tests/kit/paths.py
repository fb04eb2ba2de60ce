"""Paths in the repository, for tests that read its files or run its code."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT_SRC = REPO / "agent"
DOCS = REPO / "docs"
CORPUS = REPO / "tests" / "data" / "serial-corpus"
