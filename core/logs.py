"""Structured (logfmt) logging, quiet by default: warnings only unless ``--log-level``/``TANDEM_LOG`` says more."""

from __future__ import annotations

import logging
import os
import sys


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage().replace('"', '\\"')
        line = (
            f"ts={self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} level={record.levelname.lower()} "
            f'logger={record.name} msg="{msg}"'
        )
        fields = getattr(record, "fields", None)  # log.info("...", extra={"fields": {...}}): key=value pairs
        if fields:
            line += "".join(f" {k}={v}" if " " not in str(v) else f' {k}="{v}"' for k, v in fields.items())
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def configure(level: str | None = None) -> None:
    level = (level or os.environ.get("TANDEM_LOG") or "warning").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger("tandem")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
