"""Command-line logging: one level on the root logger and on its handlers, to stderr.

The handlers get the level too, so a library that sets its own logger to DEBUG (bm25s does on
import) prints at our level only, not every debug line it makes."""

from __future__ import annotations

import logging
import sys

TRACE = 5
"""uvicorn's level below DEBUG (`serve --log-level trace`); logging has no name for it until
uvicorn is imported."""


def setup_logging(level: int | str) -> None:
    """Log to stderr at `level` (a number or a name such as "INFO" or "TRACE"); a second call
    changes the level of the first's handler."""
    if isinstance(level, str) and level.upper() == "TRACE":
        logging.addLevelName(TRACE, "TRACE")
        level = TRACE
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.setLevel(level)
