"""`Answer`: what one GET of the view's probes returned, or why nothing came back.

Pure data, shared by probe.py (which makes them) and snapshot.py (which reads them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer"]


@dataclass(frozen=True, slots=True)
class Answer:
    """One GET: the HTTP status and body, or why nothing came back."""

    status: int | None  # None: no HTTP answer at all (refused, timed out, not HTTP)
    body: bytes = b""
    error: str | None = None  # set whenever status is not 2xx, in words for the screen

    @property
    def is_ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not."""
        return json.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")
