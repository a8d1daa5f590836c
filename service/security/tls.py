"""TLS for the server: certificate files, optional client certificates (mTLS),
and reloading them without dropping a connection.

grpc asks `ServerTLS` for a certificate configuration before every new
handshake; `reload()` (on SIGHUP) reads the files again and hands the result
to the next handshake, so new connections get the new certificate while the
streams already open carry on over theirs.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TLSConfig:
    """PEM files: the server's certificate chain and key; with `client_ca_file`,
    clients must present a certificate signed by that CA (mTLS)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def __post_init__(self) -> None:
        for path in (self.cert_file, self.key_file, self.client_ca_file):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    def read(self) -> grpc.ServerCertificateConfiguration:
        """The files as a grpc certificate configuration; ValueError if they do not make one."""
        try:
            # The standard library checks that the key matches the certificate.
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file is not None:
                ssl.create_default_context(cafile=str(self.client_ca_file))
            cert, key = Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes()
            ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file is not None else None
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot use the TLS files: {e}") from None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class ServerTLS:
    """The server's TLS credentials; `reload()` re-reads the files for new connections."""

    def __init__(self, config: TLSConfig):
        self.config = config
        self._lock = threading.Lock()
        self._next: grpc.ServerCertificateConfiguration | None = None
        self.credentials = grpc.dynamic_ssl_server_credentials(
            config.read(), self._fetch, require_client_authentication=config.client_ca_file is not None)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by grpc before each handshake, on one of its threads: no I/O here.
        with self._lock:
            config, self._next = self._next, None
        return config

    def reload(self) -> bool:
        """Read the files again; False (and the old ones kept) if they are not usable."""
        try:
            config = self.config.read()
        except ValueError as e:
            log.error("TLS reload failed, keeping the current certificate: %s", e)
            return False
        with self._lock:
            self._next = config
        log.info("TLS certificate files reloaded; new connections use them")
        return True
