"""TLS and mTLS on the server's port, certificates reloaded without dropping
streams, a plaintext health port for probes, TLS from the CLI clients."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.cli import main
from service.gen.stencil.v1 import generate_pb2 as pb
from service.gen.stencil.v1 import generate_pb2_grpc as pb_grpc
from service.security.tls import TLSConfig

from .certs import CertificateAuthority
from .helpers import TIMEOUT, ServerHandle, greedy

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CertificateAuthority(d, "ca"), CertificateAuthority(d, "other")
    return {"ca": ca, "other": other, "server": ca.issue("server", server=True),
            "client": ca.issue("client", server=False), "stranger": other.issue("client", server=False),
            "other_server": other.issue("server", server=True)}


def tokenize(address: str, credentials: grpc.ChannelCredentials | None) -> list[int]:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return list(pb_grpc.GenerationStub(channel).Tokenize(pb.TokenizeRequest(text="hello"), timeout=TIMEOUT_S)
                    .token_ids)


def refused(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        tokenize(address, credentials)
    return info.value.code()  # type: ignore[attr-defined, no-any-return]


def creds(ca: CertificateAuthority, client: object = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        ca.cert.read_bytes(), client.key.read_bytes() if client else None,  # type: ignore[attr-defined]
        client.cert.read_bytes() if client else None)  # type: ignore[attr-defined]


def test_tls_serves_and_plaintext_is_refused(make_server: Callable[..., ServerHandle], pki: dict) -> None:
    handle = make_server(tls=TLSConfig(pki["server"].cert, pki["server"].key), health_port=0)
    assert tokenize(handle.address, creds(pki["ca"]))
    assert refused(handle.address, None) == grpc.StatusCode.UNAVAILABLE
    assert refused(handle.address, creds(pki["other"])) == grpc.StatusCode.UNAVAILABLE  # untrusted server


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(make_server: Callable[..., ServerHandle],
                                                             pki: dict) -> None:
    handle = make_server(tls=TLSConfig(pki["server"].cert, pki["server"].key, pki["ca"].cert))
    assert tokenize(handle.address, creds(pki["ca"], pki["client"]))
    assert refused(handle.address, creds(pki["ca"])) == grpc.StatusCode.UNAVAILABLE
    assert refused(handle.address, creds(pki["ca"], pki["stranger"])) == grpc.StatusCode.UNAVAILABLE


def test_certificates_reload_without_dropping_streams(make_server: Callable[..., ServerHandle], pki: dict,
                                                      tmp_path: Path) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server-key.pem"
    shutil.copy(pki["server"].cert, cert)
    shutil.copy(pki["server"].key, key)
    handle = make_server(tls=TLSConfig(cert, key))
    channel = grpc.secure_channel(handle.address, creds(pki["ca"]))
    stream = pb_grpc.GenerationStub(channel).Generate(greedy("a long one", 200), timeout=TIMEOUT)
    first = next(iter(stream))
    assert first.HasField("chunk")
    # The operator rotates to a certificate of another CA, then sends SIGHUP.
    shutil.copy(pki["other_server"].cert, cert)
    shutil.copy(pki["other_server"].key, key)
    assert handle.server.reload_tls()
    assert tokenize(handle.address, creds(pki["other"]))  # new connections: the new certificate
    assert refused(handle.address, creds(pki["ca"])) == grpc.StatusCode.UNAVAILABLE
    rest = list(stream)  # the stream opened before the reload runs to its end
    assert rest[-1].HasField("complete")
    channel.close()
    # Unusable files are refused and the current certificate is kept.
    key.write_text("not a key")
    assert not handle.server.reload_tls()
    assert tokenize(handle.address, creds(pki["other"]))


def test_a_plaintext_health_port_answers_probes(make_server: Callable[..., ServerHandle], pki: dict) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    handle = make_server(tls=TLSConfig(pki["server"].cert, pki["server"].key), health_port=free)
    assert handle.server.health_port == free
    with grpc.insecure_channel(f"127.0.0.1:{free}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # the health port serves nothing else
            pb_grpc.GenerationStub(channel).Tokenize(pb.TokenizeRequest(text="x"), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]


def test_cli_clients_speak_tls(make_server: Callable[..., ServerHandle], pki: dict,
                               capsys: pytest.CaptureFixture[str]) -> None:
    handle = make_server(tls=TLSConfig(pki["server"].cert, pki["server"].key, pki["ca"].cert))
    args = ["generate", "Hello", "--port", str(handle.port), "--max-new-tokens", "4", "--temperature", "0",
            "--usage", "--tls-ca", str(pki["ca"].cert)]
    assert main([*args, "--tls-cert", str(pki["client"].cert), "--tls-key", str(pki["client"].key)]) == 0
    assert "length" in capsys.readouterr().err.lower()
    assert main(args) == 1  # mTLS: no client certificate, no answer
    with pytest.raises(SystemExit) as exit_code:  # a certificate needs its key
        main([*args, "--tls-cert", str(pki["client"].cert)])
    assert exit_code.value.code == 2
