"""What the telemetry counts of a call's constraint compile."""

from __future__ import annotations

import pytest

from grammar import GrammarError
from service.ops.request_log import CallRecord, CompileNote
from service.ops.telemetry import Telemetry, TelemetryConfig
from service.structured import _outcome


@pytest.mark.parametrize("error, outcome, counted", [
    (GrammarError("waited for a worker", reason="timeout"), "busy", False),
    (GrammarError("no worker could start", reason="crashed"), "unavailable", False),
    (GrammarError("compile ran out of time", reason="timeout", backend="xgrammar"), "timeout", True),
    (GrammarError("bad regex", backend="llguidance"), "invalid", True),
])
def test_only_the_constraints_own_failures_count_as_compile_failures(error: GrammarError, outcome: str,
                                                                      counted: bool) -> None:
    """A constraint that waited its whole timeout for a busy worker is an
    admission refusal (RESOURCE_EXHAUSTED), not a compile timeout: it was
    counted in stencil_grammar_compile_timeouts_total, so alerts on hostile
    grammars fired on a full queue."""
    assert _outcome(error) == outcome
    telemetry = Telemetry(TelemetryConfig(metrics_port=0))  # a registry; nothing served until start()
    m = telemetry.metrics
    assert m is not None
    record = CallRecord("/stencil.v1.Generation/Generate", "r", "peer", 0.0, code="INVALID_ARGUMENT",
                        compile=CompileNote("regex", error.backend, 0.0, 10.0, outcome, cached=False))
    telemetry._count(record)
    assert m.compile_failures.labels("regex", outcome)._value.get() == int(counted)
    assert m.compile_timeouts.labels("regex")._value.get() == int(outcome == "timeout")


def test_only_answered_embed_calls_count_as_embeddings() -> None:
    # A refused Embed (bad input, over a limit) embedded nothing: counting it
    # (and its latency) made the embedding dashboards read errors as work.
    from service.ops.telemetry import EMBED_METHOD

    telemetry = Telemetry(TelemetryConfig(metrics_port=0))
    m = telemetry.metrics
    assert m is not None
    name = telemetry.embedding_model
    for code, inputs in (("OK", 3), ("INVALID_ARGUMENT", 5), ("RESOURCE_EXHAUSTED", 7)):
        record = CallRecord(EMBED_METHOD, "r", "peer", 0.0, code=code, inputs=inputs)
        record.end = 0.25
        telemetry._count(record)
    assert m.embed_requests.labels(name)._value.get() == 1
    assert m.embed_inputs.labels(name)._value.get() == 3
