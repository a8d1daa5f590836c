"""`SchemaStore`: the documents a JSON schema's `$ref` may name by URI.

A schema can refer to another document (`"$ref":
"https://schemas.example.com/address.json#/$defs/street"`). stencild never
fetches anything over the network at request time: an operator mirrors the
documents into a directory and maps a URI prefix onto it
(`stencild serve --schema-store https://schemas.example.com/=./schemas`).
The normalizer then inlines the referenced parts into the grammar, and the
output validators read the same documents, so a request's schema behaves as
if the documents were bundled in it. A URI outside every prefix, or one whose
file is missing, stays unresolved (the schema then fails to compile, as before).

Documents are read on first use and kept for the life of the process; the
store is picklable, so compile worker processes get their own copy.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag

log = logging.getLogger(__name__)

# A document larger than this is refused (it would be inlined into grammars).
MAX_DOCUMENT_BYTES = 1 << 20


class SchemaStore:
    """URI prefix -> local directory of JSON schema documents (read-only).

    `get(uri)` returns the parsed document for `uri` (its fragment ignored),
    read from the file at the same relative path under the prefix's directory,
    with `.json` appended when the exact name does not exist; None when no
    prefix matches or there is no such file. Paths never leave the directory.
    """

    def __init__(self, roots: dict[str, str | Path]) -> None:
        self.roots = {prefix: Path(path).resolve() for prefix, path in roots.items()}
        for prefix, path in self.roots.items():
            if not prefix:
                raise ValueError("a schema store prefix cannot be empty")
            if not path.is_dir():
                raise ValueError(f"schema store directory {str(path)!r} (for {prefix!r}) does not exist")
        self._lock = threading.Lock()
        self._documents: dict[str, Any] = {}

    @classmethod
    def parse(cls, mappings: Iterable[str]) -> SchemaStore | None:
        """A store from `PREFIX=DIR` strings (None when there are none)."""
        roots: dict[str, str | Path] = {}
        for mapping in mappings:
            prefix, sep, path = mapping.rpartition("=")
            if not sep or not prefix or not path:
                raise ValueError(f"expected URI_PREFIX=DIRECTORY, got {mapping!r}")
            roots[prefix] = path
        return cls(roots) if roots else None

    def __getstate__(self) -> dict[str, Any]:
        return {"roots": {k: str(v) for k, v in self.roots.items()}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["roots"])  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SchemaStore) and other.roots == self.roots

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, str(v)) for k, v in self.roots.items())))

    def get(self, uri: str) -> Any | None:
        """The document `uri` names, or None."""
        uri = urldefrag(uri)[0]
        with self._lock:
            if uri in self._documents:
                return self._documents[uri]
        document = self._read(uri)
        with self._lock:
            self._documents.setdefault(uri, document)
        return document

    def retrieve(self, uri: str) -> Any:
        """`get` for jsonschema-rs's `retriever`: raises for an unknown URI."""
        document = self.get(uri)
        if document is None:
            raise ValueError(f"{uri} is not in the schema store (nothing is fetched)")
        return document

    def _read(self, uri: str) -> Any | None:
        # The longest matching prefix wins: a mirror of a sub-tree overrides its parent.
        for prefix in sorted(self.roots, key=len, reverse=True):
            if not uri.startswith(prefix):
                continue
            root = self.roots[prefix]
            relative = uri[len(prefix):].lstrip("/")
            for name in (relative, relative + ".json"):
                if not name:
                    continue
                path = (root / name).resolve()
                if not path.is_relative_to(root) or not path.is_file():
                    continue
                if path.stat().st_size > MAX_DOCUMENT_BYTES:
                    log.warning("schema store: %s is larger than %d bytes; not used", path, MAX_DOCUMENT_BYTES)
                    return None
                try:
                    return json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    log.warning("schema store: cannot read %s: %s", path, e)
                    return None
            return None
        return None
