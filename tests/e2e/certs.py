"""Throwaway certificates for TLS tests: a CA, server and client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))


@dataclass
class Issued:
    """A certificate and its key, written as PEM files."""

    cert: Path
    key: Path


class CertificateAuthority:
    """A self-signed CA that issues server (localhost, 127.0.0.1) and client certificates."""

    def __init__(self, directory: Path, name: str):
        self.dir = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        builder = _validity(x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                            .public_key(self._key.public_key()).serial_number(x509.random_serial_number()))
        self._cert = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True) \
            .sign(self._key, hashes.SHA256())
        self.cert = self._write(f"{name}-ca.pem", self._cert.public_bytes(serialization.Encoding.PEM))

    def _write(self, filename: str, data: bytes) -> Path:
        path = self.dir / filename
        path.write_bytes(data)
        return path

    def issue(self, common_name: str, server: bool) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _validity(x509.CertificateBuilder().subject_name(_name(common_name))
                            .issuer_name(self._cert.subject).public_key(key.public_key())
                            .serial_number(x509.random_serial_number()))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).sign(self._key, hashes.SHA256())
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return Issued(self._write(f"{self.name}-{common_name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
                      self._write(f"{self.name}-{common_name}-key.pem", key_pem))
