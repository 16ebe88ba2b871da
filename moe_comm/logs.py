"""The ``moe_comm`` logger and its switch, ``MOE_COMM_LOG_LEVEL``.

    MOE_COMM_LOG_LEVEL=INFO python train.py     # backend, transport, buffer sizes, deadlines
    MOE_COMM_LOG_LEVEL=DEBUG python train.py    # and how the ranks of a group were placed

Every module logs to ``moe_comm`` or a child of it (``moe_comm.transport``). Without the
variable nothing is changed: Python's default applies (warnings and errors reach stderr).
With it, :func:`apply_env_level` (run when ``moe_comm`` is imported) sets the level of the
``moe_comm`` logger and attaches a stderr handler that stays silent while the root logger has
handlers of its own, so an application that configures logging, before or after importing
moe_comm, sees each record once, formatted its way.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

ENV = "MOE_COMM_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

log = logging.getLogger("moe_comm")


class FallbackHandler(logging.StreamHandler):
    """Writes to stderr only while no other handler would: once the application configures
    logging (the root logger, or ``moe_comm`` itself), records reach its handlers and this one
    steps aside."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers and log.handlers == [self]:
            super().emit(record)


def parse_level(text: str) -> int | None:
    """``INFO``, ``debug``, ``20``... as a logging level; None for anything else."""
    text = text.strip().upper()
    if text.isdigit():
        return int(text)
    return getattr(logging, text) if text in LEVELS else None


def apply_env_level(environ=None) -> int | None:
    """Apply ``MOE_COMM_LOG_LEVEL`` to the ``moe_comm`` logger; returns the level set, or None
    (unset or not understood: a typo warns rather than failing the import of the library)."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    if not text.strip():
        return None
    level = parse_level(text)
    if level is None:
        warnings.warn(f"{ENV}={text!r} is not a logging level (one of {', '.join(LEVELS)} or "
                      "a number); moe_comm's logging is left as it is", stacklevel=2)
        return None
    log.setLevel(level)
    if not any(isinstance(h, FallbackHandler) for h in log.handlers):
        log.addHandler(FallbackHandler())
    return level


_said = set()


def info_once(logger: logging.Logger, key, msg: str, *args) -> None:
    """Log ``msg`` at INFO the first time ``key`` is seen in this process (a choice made per
    Buffer, such as the transport, is news once, not on every Buffer)."""
    if key not in _said:
        _said.add(key)
        logger.info(msg, *args)
