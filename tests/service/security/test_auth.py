"""API key files and the constant-time key match."""

from __future__ import annotations

import pytest

from service.security.auth import ApiKey, ApiKeyAuth, load_keys, parse_keys


def test_key_entries_parse_with_names_and_limits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    path.write_text("\n# comment\nsk-a\nsk-b ops\nsk-c batch:8  # the batch jobs\n"
                    "Tr0ub4dor#3-horse alice:2 #a '#' inside a secret is part of it\nsk-r smg router\n")
    keys = load_keys(path, "ignored-when-a-file-is-given")
    assert [(k.name, k.secret, k.max_inflight, k.router) for k in keys] == \
        [("key-1", "sk-a", None, False), ("ops", "sk-b", None, False), ("batch", "sk-c", 8, False),
         ("alice", "Tr0ub4dor#3-horse", 2, False), ("smg", "sk-r", None, True)]
    assert [k.name for k in load_keys(None, "sk-x one, sk-y two:2")] == ["one", "two"]
    assert load_keys(None, None) == []
    assert "sk-c" not in repr(keys[2]), "a key's secret never shows in its repr"


@pytest.mark.parametrize("text", ["", "# keys go here\n", "#Zq8r!k2N0tAComment ops\n"])
def test_a_key_file_with_no_key_is_refused_not_served_without_authentication(tmp_path, text: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="holds no API key"):
        load_keys(path, None)
    with pytest.raises(ValueError, match="holds no API key"):
        load_keys(None, " , ")
    # Set but empty (an empty Kubernetes Secret) served without keys.
    with pytest.raises(ValueError, match="holds no API key"):
        load_keys(None, "")


def test_a_key_files_byte_order_mark_is_not_part_of_its_first_secret(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Windows editors write one; the first key then never matched.
    path = tmp_path / "keys"
    path.write_bytes(b"\xef\xbb\xbfsk-first alice\nsk-second bob\n")
    assert [k.secret for k in load_keys(path, None)] == ["sk-first", "sk-second"]


@pytest.mark.parametrize("entries, problem", [
    (["sk-a one extra"], "SECRET"),
    (["sk-a one router more"], "SECRET"),
    (["sk-a a/b"], "without '/'"),
    (["sk-a one:0"], "positive integer"),
    (["sk-a one:many"], "positive integer"),
    (["sk-a one", "sk-b one"], "unique"),
    (["sk-a one", "sk-a two"], "same key"),
])
def test_bad_entries_are_refused(entries: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_keys(entries, "test")


def test_a_key_matches_only_exactly() -> None:
    auth = ApiKeyAuth([ApiKey("a", "sk-a"), ApiKey("b", "sk-b")])
    assert auth.match((("authorization", "Bearer sk-b"),)).name == "b"  # type: ignore[union-attr]
    # The scheme is case-insensitive (RFC 7235); the key is not.
    for scheme in ("bearer", "BEARER", "beaRer"):
        assert auth.match((("authorization", f"{scheme} sk-b"),)).name == "b"  # type: ignore[union-attr]
    assert auth.match((("authorization", "Bearer SK-B"),)) is None
    for metadata in [(), (("authorization", "Bearer sk-"),), (("authorization", "sk-a"),),
                     (("authorization", "Bearer sk-ab"),), (("x-api-key", "sk-a"),)]:
        assert auth.match(metadata) is None


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code, message, trailing_metadata=()):  # type: ignore[no-untyped-def]
        raise _Aborted(code)


def test_a_limited_keys_refusal_is_named_and_a_stream_closed_elsewhere_gives_its_slot_back() -> None:
    """A KEY_LIMIT_REACHED refusal names its limit (it was counted as "other");
    a streaming handler closed in another context (asyncio's async-generator
    finalizer) still gives its key's slot back (the context variable's reset
    raised first and the slot leaked, refusing the key for good)."""
    import asyncio
    import contextlib

    import grpc

    from service.interceptors import rewrap
    from service.ops.request_log import CallRecord, enter_call, exit_call

    key = ApiKey("carol", "sk-carol", max_inflight=1)
    auth = ApiKeyAuth([key])
    record = CallRecord("/stencil.v1.Generation/Tokenize", "r1", "peer", 0.0)

    async def behavior(request, context):  # type: ignore[no-untyped-def]
        yield 1
        yield 2

    wrapped = rewrap(grpc.unary_stream_rpc_method_handler(behavior),
                     scope=lambda _r, c: auth._call(key, False, True, c))

    async def run() -> None:
        gen = wrapped.unary_stream(object(), _Context())
        assert await asyncio.create_task(gen.__anext__()) == 1  # holds the only slot
        token = enter_call(record)
        try:
            with pytest.raises(_Aborted) as info:
                async with auth._call(key, False, True, _Context()):
                    pass
            assert info.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            exit_call(token)
        with contextlib.suppress(ValueError):
            await asyncio.create_task(gen.aclose())

    asyncio.run(run())
    assert record.refusal == "key_max_inflight"
    assert auth._inflight["carol"] == 0, "the key's in-flight slot leaked"


def test_keys_reloaded_away_drop_their_counts_once_their_calls_end() -> None:
    # SIGHUP's reload kept every removed key's count for good, and a call that
    # matched a key just before its removal would fail on its missing count.
    import asyncio

    old, kept = ApiKey("old", "sk-old", max_inflight=2), ApiKey("kept", "sk-kept")
    auth = ApiKeyAuth([old, kept])

    async def run() -> None:
        async with auth._call(old, False, True, _Context()):  # in flight across the reload
            auth.replace_keys([kept, ApiKey("new", "sk-new")])
            assert auth._inflight == {"old": 1, "kept": 0, "new": 0}
        assert auth._inflight["old"] == 0
        auth.replace_keys([kept])
        assert set(auth._inflight) == {"kept"}
        async with auth._call(old, False, True, _Context()):  # matched before it went
            pass

    asyncio.run(run())
