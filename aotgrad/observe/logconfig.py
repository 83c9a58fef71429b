"""``AOTGRAD_LOG``: ``quiet`` silences aotgrad (no progress line, errors only);
``info`` or ``debug`` prints aotgrad's log records (stage timings are debug) to stderr.
Everything logs under ``aotgrad.*`` names, so ``logging`` can configure it as usual."""
from __future__ import annotations

import logging
import os

_LEVELS = {"quiet": logging.ERROR, "info": logging.INFO, "debug": logging.DEBUG}


def configure(value: str | None = None) -> None:
    value = (value if value is not None else os.environ.get("AOTGRAD_LOG", "")).strip().lower()
    level = _LEVELS.get(value)
    if level is None:
        return
    root = logging.getLogger("aotgrad")
    root.setLevel(level)
    if value != "quiet" and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        root.addHandler(handler)


configure()
