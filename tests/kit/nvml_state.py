"""The scripted NVML's state file (tests/kit/nvml_child/pynvml.py), written whole.

The fake re-reads the file at every call and every 50 ms while a call blocks, so a test that
rewrites it with ``Path.write_text`` (truncate, then write) can be read in between: an empty or
half file, a JSON error in the probe child, an error sample instead of the GPUs (a flake seen in
a clean-clone run, 2026-12-05). ``os.replace`` makes the new state appear at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write(path: Path, state: dict[str, Any]) -> None:
    """Replace the state file with ``state`` in one step (a temp file beside it, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
