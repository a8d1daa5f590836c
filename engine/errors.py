"""Errors the engine reports about a request (the service maps them to gRPC codes)."""

from __future__ import annotations

from typing import Any


class InvalidRequest(ValueError):
    """A request the engine cannot run as given; `field` names the culprit and
    `index` the item of a list field at fault, when there is one."""

    def __init__(self, field_name: str, message: str, index: int | None = None):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.description = message
        self.index = index

    def __reduce__(self) -> tuple[type, tuple[str, str, int | None]]:
        # Rebuilt from its fields (the default passes the formatted message
        # alone, which __init__ refuses): a rejection crossing the engine
        # process's pipe stays an InvalidRequest.
        return type(self), (self.field, self.description, self.index)


class RequestFailed(RuntimeError):
    """Requests of an offline `LLM.generate` call failed through no fault of
    their input (a server-side fault: a step that broke, a failed decode).

    Raised once every request of the call has ended, at any batch size:
    `outputs` holds every result in prompt order (the failed ones with
    finish_reason "error" and `error` set), `failed` their request ids.
    """

    def __init__(self, outputs: list[Any], failed: list[str]):
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed: "
                         + "; ".join(f"{o.request_id}: {o.error}" for o in outputs if o.request_id in failed))
        self.outputs = outputs
        self.failed = failed

    def __reduce__(self) -> tuple[type, tuple[list[Any], list[str]]]:
        # As InvalidRequest's: a call run in a worker process raises it intact.
        return type(self), (self.outputs, self.failed)
