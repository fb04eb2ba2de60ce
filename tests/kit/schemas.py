"""The JSON Schemas of the --json outputs (gce_watchdog/schemas/, docs/json.md): load one,
validate a real output against it (jsonschema, a dev dependency only)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from kit.paths import AGENT_SRC

SCHEMAS = AGENT_SRC / "gce_watchdog" / "schemas"


def schema(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return doc


def validate(name: str, doc: object) -> None:
    """Raises jsonschema.ValidationError when ``doc`` is not what ``name``'s schema says."""
    cls = jsonschema.Draft202012Validator
    cls(schema(name), format_checker=cls.FORMAT_CHECKER).validate(doc)
