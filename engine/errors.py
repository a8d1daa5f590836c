"""Errors the engine reports about a request (the service maps them to gRPC codes)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine cannot run as given; `field` names the culprit and
    `index` the item of a list field at fault, when there is one."""

    def __init__(self, field_name: str, message: str, index: int | None = None):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.description = message
        self.index = index
