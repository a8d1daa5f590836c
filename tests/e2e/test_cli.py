"""The `stencild` command line: generate against a live server, make-model, argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.presets import ensure_preset
from service.cli import main

from .helpers import ServerHandle


def test_generate_streams_text(server: ServerHandle, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "Tell me a story", "--port", str(server.port), "--max-new-tokens", "8",
               "--temperature", "0", "--usage"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip(), "some text was printed"
    assert "[LENGTH]" in err or "[EOS]" in err
    rc = main(["generate", "Hi", "--chat", "--port", str(server.port), "--max-new-tokens", "4"])
    assert rc == 0


def test_generate_strict_json_reports_how_the_schema_fared(server: ServerHandle, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "array", "items": {"type": "integer"}, "uniqueItems": true, "maxItems": 3}')
    rc = main(["generate", "Numbers:", "--port", str(server.port), "--max-new-tokens", "48",
               "--temperature", "0", "--json-schema", str(schema), "--strict", "--usage"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "; schema " in err and "not enforced token by token: uniqueItems" in err
    if "[EOS]" in err:
        assert "schema VALID" in err and len(set(json.loads(out))) == len(json.loads(out))
    # --strict with a regex: the server names the field.
    rc = main(["generate", "x", "--port", str(server.port), "--regex", "a+", "--strict"])
    assert rc == 1 and "constraint.strict" in capsys.readouterr().err
    # --no-resample reaches the server (it refuses it beside --strict).
    rc = main(["generate", "x", "--port", str(server.port), "--json-schema", str(schema), "--strict",
               "--no-resample"])
    assert rc == 1 and "constraint.resample" in capsys.readouterr().err


def test_generate_reports_status_errors(server: ServerHandle, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "x", "--port", str(server.port), "--temperature", "-1"])
    _, err = capsys.readouterr()
    assert rc == 1
    assert "INVALID_ARGUMENT" in err and "sampling.temperature" in err


def test_make_model_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--preset", "tiny-llama", str(tmp_path / "m")]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "m" / name).exists(), name
    assert main(["make-model", "--preset", "no-such-preset", str(tmp_path / "x")]) == 2


def test_serve_rejects_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_serve_rejects_bad_embedding_and_grammar_options(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--embedding-only", "--no-embedding-model"]) == 2
    assert "--embedding-only" in capsys.readouterr().err
    assert main(["serve", "--embedding-only", "--preset", "tiny-llama"]) == 2
    assert main(["serve", "--embedding-model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--preset", "tiny-llama", "--grammar-timeout", "0"])
    assert exit_.value.code == 2 and "--grammar-timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--grammar-backend", "outlines"])
    with pytest.raises(SystemExit):
        main(["serve", "--embedding-model", str(tmp_path), "--no-embedding-model"])


def test_serve_refuses_engine_flags_beside_embedding_only(capsys: pytest.CaptureFixture[str]) -> None:
    # They were ignored without a word, even --num-steps 4 with overlap, refused otherwise.
    assert main(["serve", "--embedding-only", "--max-model-len", "64", "--num-steps", "4", "--engine-process"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len, --num-steps, --engine-process would do nothing" in err
    assert main(["serve", "--embedding-only", "--dtype", "float16"]) == 2
    assert "--dtype would do nothing" in capsys.readouterr().err
    from service.cli import build_parser
    from service.cli.serve import ServePlan, plan_serve

    # Saying what is the default anyway is no engine flag.
    for same in (["--dtype", "auto"], ["--kv-cache-gib", "1"]):
        assert isinstance(plan_serve(build_parser().parse_args(["serve", "--embedding-only", *same])), ServePlan)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_serve_refuses_a_cuda_device_this_machine_lacks_before_binding(device: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # It bound the port, then failed loading inside torch.cuda.Stream with a traceback.
    for extra in ([], ["--engine-process"], ["--embedding-only"]):
        assert main(["serve", "--preset", "tiny-llama", "--device", device, *extra]
                    if "--embedding-only" not in extra else ["serve", "--device", device, *extra]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err


def test_serve_refuses_a_bad_log_level_and_unusable_tls_files(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Both ended in a traceback: the log level inside logging's set-up, the TLS
    files inside the running server."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--log-level", "verbose"])
    assert exit_.value.code == 2 and "not a log level" in capsys.readouterr().err
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    assert main(["serve", "--preset", "tiny-llama", "--tls-cert", str(bad), "--tls-key", str(bad)]) == 2
    assert "cannot use the TLS files" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "x", "--seed", "-1"], "--seed"),
    (["generate", "x", "--max-new-tokens", "-5"], "--max-new-tokens"),
    (["generate", "x", "--top-k", str(2**40)], "--top-k"),
    (["generate", "x", "--max-thinking-tokens", "-1"], "--max-thinking-tokens"),
    (["embed", "x", "--dimensions", "-1"], "--dimensions"),
])
def test_client_flags_a_field_cannot_hold_exit_2(argv: list[str], flag: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A value out of its protobuf field's range ended in a ValueError traceback."""
    assert main([*argv, "--port", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"stencild: {flag}: ")


@pytest.mark.parametrize("argv, flag", [
    (["generate", "x", "--json-schema", "{bad_utf8}"], "--json-schema"),
    (["generate", "x", "--lark", "{missing}"], "--lark"),
    (["generate", "x", "--strict"], "--strict"),
    (["generate", "x", "--whitespace", "compact"], "--whitespace"),
    (["generate", "x", "--api-key", "two\nlines"], "--api-key"),
    (["embed", "x", "--api-key", "clé"], "--api-key"),
    (["say", "x", "-o", "{tmp}"], "--output"),
    (["say", "x", "-o", "{missing}/x.wav"], "--output"),
])
def test_client_flags_it_cannot_use_exit_2_before_any_call(argv: list[str], flag: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Each ended in a traceback, an INTERNAL from grpc, or (say -o a folder)
    after the whole speech was made; a lone --strict got the server's refusal
    naming no flag."""
    (tmp_path / "bad.json").write_bytes(b'{"type": "\xff"}')
    names = {"bad_utf8": str(tmp_path / "bad.json"), "missing": str(tmp_path / "nothing"), "tmp": str(tmp_path)}
    assert main([a.format(**names) for a in argv] + ["--port", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"stencild: {flag}: ")


@pytest.mark.parametrize("flags, says", [
    (["--max-message-mb", "2048"], "--max-message-mb"),
    (["--max-message-mb", "inf"], "--max-message-mb"),
    (["--keepalive-time", "1e8"], "ping_interval_s must be at most"),
    (["--max-connection-age", "nan"], "--max-connection-age"),
    (["--grace-period", "nan"], "--grace-period"),
    # These failed only once the server had bound its port (the model could
    # not load), or served with every constrained request failing INTERNAL.
    (["--kv-cache-gib", "nan"], "--kv-cache-gib"),
    (["--kv-cache-gib", "inf"], "--kv-cache-gib"),
    (["--grammar-timeout", "nan"], "--grammar-timeout"),
    # Refused naming an internal field, not the flag.
    (["--grace-period", "-1"], "--grace-period"),
    (["--keepalive-time", "0"], "--keepalive-time"),
    (["--max-pending-requests", "0"], "--max-pending-requests"),
])
def test_serve_refuses_values_grpc_cannot_take(flags: list[str], says: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Past a C int grpc's channel arguments overflowed inside the starting server
    (a traceback, exit 1); NaN passed every `< 0` check. Each is refused before
    anything starts, exit 2, naming its flag."""
    try:
        code = main(["serve", "--embedding-only", "--metrics-port", "0", *flags])
    except SystemExit as exit_:  # argparse's refusal
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    assert says in capsys.readouterr().err


def test_keepalive_times_below_a_millisecond_are_not_zero() -> None:
    # grpc reads 0 ms as "off" (max connection age) or as no interval at all.
    from service.server import KeepalivePolicy

    options = dict(KeepalivePolicy(ping_interval_s=0.0001, max_connection_age_s=0.0001).options())
    assert options["grpc.keepalive_time_ms"] == 1 and options["grpc.max_connection_age_ms"] == 1


def test_generate_system_implies_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    """--system without --chat was accepted and dropped."""
    from service.gen.stencil.v1 import generate_pb2 as pb
    from service.gen.stencil.v1 import generate_pb2_grpc

    sent: list[pb.GenerateRequest] = []

    class Stub:
        def __init__(self, channel: object) -> None:
            pass

        def Generate(self, req: pb.GenerateRequest, **_: object) -> object:
            sent.append(req)
            return iter([pb.GenerateResponse(complete=pb.GenerateComplete())])

    monkeypatch.setattr(generate_pb2_grpc, "GenerationStub", Stub)
    assert main(["generate", "Hello", "--system", "You are terse.", "--port", "1"]) == 0
    assert [(m.role, m.content) for m in sent[0].chat.messages] == [("system", "You are terse."), ("user", "Hello")]


def test_serve_speech_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli import build_parser
    from service.cli.serve import ServePlan, plan_serve

    from .conftest import shared_plan

    def plan(*args: str) -> ServePlan:
        made = plan_serve(build_parser().parse_args(["serve", "--preset", "tiny-llama", *args]))
        assert isinstance(made, ServePlan), made
        return made

    # By default the demo speech pair, on an engine of its own.
    default = plan()
    assert default.speech is not None and default.speech.model_name == "demo-speech"
    assert not default.speech.shared
    assert plan("--no-speech-model").speech is None
    # --speech-model equal to --model: one engine serves both.
    shared = shared_plan()
    assert shared.speech is not None and shared.speech.shared
    for args, message in [
        (["--speech-model", str(tmp_path)], "no config.json"),
        (["--codec", str(tmp_path)], "--codec goes with --speech-model"),
        (["--speech-model", str(ensure_preset("demo-speech"))], "needs --codec"),
    ]:
        assert main(["serve", "--preset", "tiny-llama", *args]) == 2
        assert message in capsys.readouterr().err
    assert main(["serve", "--embedding-only", "--speech-model", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        main(["serve", "--speech-model", str(tmp_path), "--no-speech-model"])
