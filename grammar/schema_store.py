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

Documents are read on first use and kept for the life of the process (one
entry per file; a miss is not remembered, so a file added later is found);
the store is picklable, so compile worker processes get their own copy.
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
        path = self._path(urldefrag(uri)[0])
        if path is None:
            return None  # not cached: a file added later is found
        key = str(path)
        with self._lock:
            if key in self._documents:
                return self._documents[key]
        document = self._read(path)
        if document is not None:
            # Keyed by file, so the cache holds at most one entry per file in
            # the directories, however many spellings of a URI requests use.
            with self._lock:
                document = self._documents.setdefault(key, document)
        return document

    def retrieve(self, uri: str) -> Any:
        """`get` for jsonschema-rs's `retriever`: raises for an unknown URI."""
        document = self.get(uri)
        if document is None:
            raise ValueError(f"{uri} is not in the schema store (nothing is fetched)")
        return document

    def _path(self, uri: str) -> Path | None:
        """The file `uri` names inside a store directory, if there is one."""
        # The longest matching prefix wins: a mirror of a sub-tree overrides its parent.
        for prefix in sorted(self.roots, key=len, reverse=True):
            if not uri.startswith(prefix):
                continue
            root = self.roots[prefix]
            relative = uri[len(prefix):].lstrip("/")
            for name in (relative, relative + ".json"):
                if not name:
                    continue
                try:  # a name too long or with a NUL byte is no file of ours
                    path = (root / name).resolve()
                    if path.is_relative_to(root) and path.is_file():
                        return path
                except (OSError, ValueError):
                    continue
            return None
        return None

    @staticmethod
    def _read(path: Path) -> Any | None:
        try:
            if path.stat().st_size > MAX_DOCUMENT_BYTES:
                log.warning("schema store: %s is larger than %d bytes; not used", path, MAX_DOCUMENT_BYTES)
                return None
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            log.warning("schema store: cannot read %s: %s", path, e)
            return None
