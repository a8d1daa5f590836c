"""`CompiledExport`: a fresh compile's result, handed to another process's compiler.

A server whose engine runs in a process of its own compiles each constraint
twice over if each side compiles for itself: once to check it and build its
validators, once more for the engine's matchers, one after the other on the
request's way to its first token (xgrammar: 64 ms for a JSON schema over an
8k vocabulary, several times that over 128k). A compiler with
`CompilerConfig.export_compiled` instead gives each matcher of a fresh compile
its result in picklable form (`Matcher.export`), and the other side's
`compile_async(..., given=export)` loads that instead of compiling again.

What crosses is the compile worker's own payload: xgrammar's serialized
grammar, or llguidance's grammar text, the very thing a worker process sends
its parent. It stands in only for the compile it is of: the same spec (as the
backend compiled it), backend and tokenizer (all three are checked); anything
else compiles as usual. Only the first matcher of a fresh compile carries it
(`ExportSlot`): requests that shared the compile send it once, and nothing
keeps the payload once it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import GrammarSpec


@dataclass(frozen=True)
class CompiledExport:
    """One backend's compile of one spec, as a compiler over the same tokenizer loads it."""

    fingerprint: str  # TokenizerData.fingerprint of the compiler that made it
    backend: str  # "xgrammar" or "llguidance"
    spec: GrammarSpec  # what the backend compiled (a JSON schema's view for that backend)
    payload: dict[str, Any]  # a worker's compile payload (never a native object)

    def fits(self, fingerprint: str, backend: str, spec: GrammarSpec) -> bool:
        """Whether this is the compile of `spec` by `backend` over the tokenizer `fingerprint`."""
        return self.fingerprint == fingerprint and self.backend == backend and self.spec == spec


class ExportSlot:
    """A fresh compile's export, given to the first matcher made from it (`take`)."""

    __slots__ = ("_box",)

    def __init__(self, export: CompiledExport):
        self._box = [export]

    def take(self) -> CompiledExport | None:
        # One atomic pop: two matchers made at once on two threads (a compile's
        # runner and a caller joining as it finished) could both read a
        # read-then-clear's first half, and an engine process load it twice.
        try:
            return self._box.pop()
        except IndexError:
            return None


def portable_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """A compile payload another process can load: an in-process xgrammar
    compile ("thread" isolation) holds the native grammar, serialized here."""
    if "compiled" not in payload:
        return payload
    return {"json": payload["compiled"].serialize_json(), "size": payload["size"]}
