"""API key files and the constant-time key match."""

from __future__ import annotations

import pytest

from service.security.auth import ApiKey, ApiKeyAuth, load_keys, parse_keys


def test_key_entries_parse_with_names_and_limits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    path.write_text("\n# comment\nsk-a\nsk-b ops\nsk-c batch:8  # the batch jobs\n")
    keys = load_keys(path, "ignored-when-a-file-is-given")
    assert [(k.name, k.secret, k.max_inflight) for k in keys] == \
        [("key-1", "sk-a", None), ("ops", "sk-b", None), ("batch", "sk-c", 8)]
    assert [k.name for k in load_keys(None, "sk-x one, sk-y two:2")] == ["one", "two"]
    assert load_keys(None, None) == []
    assert "sk-c" not in repr(keys[2]), "a key's secret never shows in its repr"


@pytest.mark.parametrize("entries, problem", [
    (["sk-a one extra"], "SECRET"),
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
    for metadata in [(), (("authorization", "Bearer sk-"),), (("authorization", "sk-a"),),
                     (("authorization", "Bearer sk-ab"),), (("x-api-key", "sk-a"),)]:
        assert auth.match(metadata) is None
