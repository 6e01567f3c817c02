"""Step buffers and decode attention groups: pure CPU, no model."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine import attention
from services.worker.engine.attention import (
    DECODE_GROUP_MIN,
    AttentionMetadata,
    paged_attention,
)
from services.worker.engine.workspace import Workspace


def test_a_role_reuses_its_buffer_and_grows_only_when_asked_for_more() -> None:
    ws = Workspace(torch.float32, torch.device("cpu"))
    a = ws.take("act", 4, 8)
    assert a.shape == (4, 8) and a.is_contiguous()
    b = ws.take("act", 2, 8)
    assert b.data_ptr() == a.data_ptr()
    c = ws.take("act", 16, 8)
    assert c.shape == (16, 8) and ws.nbytes == 16 * 8 * 4
    assert ws.take("mask", 3, dtype=torch.int64).dtype == torch.int64


def test_views_are_kept_per_shape_and_follow_their_role_when_it_grows() -> None:
    ws = Workspace(torch.float32, torch.device("cpu"))
    small = ws.take("act", 2, 8)
    assert ws.take("act", 2, 8) is small  # no new view per layer and step
    big = ws.take("act", 16, 8)  # the role's buffer grows: its old views are dropped
    again = ws.take("act", 2, 8)
    assert again is not small and again.data_ptr() == big.data_ptr()
    assert ws.take("act", 2, 8, dtype=torch.int64).dtype == torch.int64
    assert ws.take("act", 2, 8).dtype == torch.float32


def _decode_meta(lens: list[int], groups: int, block: int = 4) -> AttentionMetadata:
    tables, next_block = [], 0
    for n in lens:
        need = -(-n // block)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    meta = AttentionMetadata()
    meta.finalize(list(range(len(lens))), tables, lens, block, torch.float32, groups=groups)
    return meta


def test_decode_groups_cover_every_row_once_and_match_one_padded_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "HOST_DECODE", False)  # the torch path's groups
    g = torch.Generator().manual_seed(1)
    lens = [3 + (7 * i) % 40 for i in range(3 * DECODE_GROUP_MIN + 2)]
    kv_heads, heads, dim, block = 2, 4, 8, 4
    slots = sum(-(-n // block) for n in lens) * block
    k_cache = torch.randn(kv_heads, slots, dim, generator=g)
    v_cache = torch.randn(kv_heads, slots, dim, generator=g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    grouped = _decode_meta(lens, groups=4, block=block)
    single = _decode_meta(lens, groups=1, block=block)
    assert len(single.decodes) == 1 and len(grouped.decodes) > 1
    assert all(len(d.rows) >= DECODE_GROUP_MIN for d in grouped.decodes)
    rows = torch.cat([d.rows for d in grouped.decodes]).sort().values
    assert rows.tolist() == list(range(len(lens)))
    for d in grouped.decodes:  # padded only to the group's longest context
        assert d.slots.shape[1] == max(lens[r] for r in d.rows.tolist())
    ws = Workspace(torch.float32, torch.device("cpu"))
    k_new = torch.empty(len(lens), kv_heads, dim)
    got = paged_attention(q, k_new, k_new, k_cache, v_cache, grouped, 0.3, workspace=ws)
    want = paged_attention(q, k_new, k_new, k_cache, v_cache, single, 0.3)
    torch.testing.assert_close(got, want)
