"""Structured logs: one JSON object a line, with ``request_id`` when a record has one."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("request_id", "service", "worker_id"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str, level: str = "INFO") -> None:
    """Routes the root logger to stderr as JSON lines tagged with ``service``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(lambda record: setattr(record, "service", service) or True)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
