"""TextContext index moves."""

from __future__ import annotations

import numpy as np
import pytest

from engine.context import FUTURE_TOKEN, GenerationStatus, TextContext


def make(prompt=(1, 2, 3, 4, 5), max_length=20) -> TextContext:
    return TextContext(tokens=np.array(prompt), max_length=max_length)


def test_prefill_in_chunks_then_decode():
    c = make()
    assert (c.start_idx, c.active_idx, c.end_idx) == (0, 5, 5)
    c.set_chunk(2)
    assert c.next_tokens.tolist() == [1, 2] and c.in_prefill
    c.mark_chunk_done()
    assert (c.start_idx, c.active_idx) == (2, 5) and c.active_length == 3
    c.update(9)
    assert (c.start_idx, c.active_idx, c.end_idx) == (5, 6, 6)
    assert c.next_tokens.tolist() == [9] and c.generated_tokens.tolist() == [9]
    assert not c.in_prefill


def test_jump_ahead_tokens_run_in_the_next_step():
    c = make()
    c.update(9)
    c.jump_ahead(10)
    c.jump_ahead(11)
    assert c.next_tokens.tolist() == [9, 10, 11] and c.num_forced_tokens == 2
    c.update(12)
    assert c.next_tokens.tolist() == [12]
    assert c.generated_tokens.tolist() == [9, 10, 11, 12]


def test_future_tokens_are_placeholders_until_realized():
    c = make()
    c.update_with_future_token()
    assert c.next_tokens.tolist() == [FUTURE_TOKEN] and c.num_final_tokens == 5
    c.update_with_future_token()
    assert c.pending_futures == 2
    c.realize_future_token(7)
    c.realize_future_token(8)
    assert c.generated_tokens.tolist() == [7, 8] and c.num_final_tokens == 7
    with pytest.raises(ValueError):
        c.realize_future_token(1)


def test_rollback_reset_and_available_steps():
    c = make()
    for t in (6, 7, 8):
        c.update(t)
    c.rollback(2)
    assert c.generated_tokens.tolist() == [6] and c.next_tokens.tolist() == [6]
    with pytest.raises(ValueError):
        c.rollback(2)
    c.reset()
    assert (c.start_idx, c.active_idx, c.end_idx) == (0, 6, 6) and c.epoch == 1
    assert c.compute_num_available_steps(max_seq_len=10) == 4
    assert c.compute_num_available_steps(max_seq_len=100) == 14


def test_buffer_grows_and_status_is_final():
    c = make(prompt=(1,), max_length=200)
    for t in range(100):
        c.update(t + 2)
    assert c.generated_tokens.tolist() == list(range(2, 102))
    c.finish(GenerationStatus.END_OF_SEQUENCE)
    c.finish(GenerationStatus.CANCELLED)
    assert c.status is GenerationStatus.END_OF_SEQUENCE and c.is_done


def test_invalid_contexts():
    with pytest.raises(ValueError):
        TextContext(tokens=np.array([], dtype=np.int64), max_length=5)
    with pytest.raises(ValueError):
        make(max_length=5)
    c = make()
    with pytest.raises(ValueError):
        c.set_chunk(6)
    with pytest.raises(ValueError):
        c.skip_cached_tokens(5)
