"""`SlotTables`: many projections' device tables in one tensor per table, written per
adapter in one go, read by each `PooledLora` as its own row."""

from __future__ import annotations

import pytest
import torch

from loraplane_kernels import PooledLora, SlotTables


def test_one_write_points_every_row_and_clear_unpoints_them() -> None:
    pool = torch.arange(200, dtype=torch.float32)
    tables = SlotTables.zeros(3, 5, pool.device)
    lora = [PooledLora(pool, 4, 6, 5, tables, row) for row in range(3)]
    assert all(w.a_offsets.shape == (5,) and w.a_offsets.data_ptr() % 16 == 0 for w in lora)
    tables.write(2, [0, 2], [10, 100], [30, 140], [2, 2], [0.5, 0.25])
    for row, a_off, b_off, scale in ((0, 10, 30, 0.5), (2, 100, 140, 0.25)):
        lora[row].point(2, a_off, b_off, 2, scale)
    assert lora[0].a_offsets.tolist() == [0, 0, 10, 0, 0]
    assert lora[2].b_offsets.tolist() == [0, 0, 140, 0, 0]
    assert lora[2].scales[2].item() == 0.25 and lora[1].ranks.tolist() == [0] * 5
    assert torch.equal(lora[2].bt_views[2], pool[140:152].view(2, 6))
    tables.clear(2)
    for w in lora:
        w.unpoint(2)
    assert not tables.ranks.any() and not tables.scales.any()
    assert all(w.a_views[2] is None and not w.adapts(2) for w in lora)


def test_a_projection_without_shared_tables_keeps_its_own() -> None:
    pool = torch.zeros(64)
    w = PooledLora(pool, 4, 4, 2)
    w.place(1, 0, 16, 3, 2.0)
    assert w.ranks.tolist() == [0, 3] and w.host_scales == [0.0, 2.0]
    w.clear(1)
    assert w.ranks.tolist() == [0, 0] and w.a_views[1] is None


def test_small_and_large_runs_both_land_and_the_thread_count_is_restored() -> None:
    """Runs under SMALL_RUN_ROWS take the one-thread pass, the rest the threaded one; each
    row gets exactly its own slot's delta, base rows and unadapted slots none."""
    from loraplane_kernels.rank_pool import SMALL_RUN_ROWS, apply_runs

    g = torch.Generator().manual_seed(0)
    fin, fout = 8, 6
    pool = torch.randn(1000, generator=g)
    w = PooledLora(pool, fin, fout, 3)
    w.point(0, 0, 100, 4, 0.5)
    w.point(2, 200, 300, 2, 2.0)
    big = SMALL_RUN_ROWS + 3
    runs = ((0, 0, 2), (2, 2, 2 + big), (-1, 2 + big, 4 + big), (1, 4 + big, 5 + big),
            (0, 5 + big, 6 + big))
    x = torch.randn(6 + big, fin, generator=g)
    y = torch.zeros(6 + big, fout + 3)
    threads = torch.get_num_threads()
    apply_runs(y, x, w, runs, out_offset=3)
    assert torch.get_num_threads() == threads
    want = torch.zeros_like(y)
    for slot, lo, hi in runs:
        if slot >= 0 and w.a_views[slot] is not None:
            a, bt = w.a_views[slot], w.bt_views[slot]
            want[lo:hi, 3:] = w.host_scales[slot] * (x[lo:hi] @ a.T) @ bt
    torch.testing.assert_close(y, want)
    assert not y[:, :3].any() and not y[2 + big:4 + big].any()


TOL = {torch.float32: {}, torch.bfloat16: {"atol": 0.1, "rtol": 0.02}}
"""bf16: the per-run reference rounds its shrink output, the nested pass may not."""


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "torch-without-nested-views"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_small_runs_take_the_nested_pass_and_match_per_run_products(
        dtype: torch.dtype, nested: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode-sized runs of many slots (repeats, gaps, base rows, an unadapted slot, ragged
    ranks and scales) go through two nested `bmm` calls; every row gets its own slot's
    delta, as the per-run loop computes it, whether the runs are one block or not and
    whether the activations start at the front of their buffer or not. A torch without
    the private nested-view function takes the loop and gets the same rows."""
    from loraplane_kernels.rank_pool import GROUPED_MIN_RUNS, apply_runs

    monkeypatch.setattr("loraplane_kernels.rank_pool.NESTED_VIEWS", nested)

    g = torch.Generator().manual_seed(1)
    fin, fout, slots = 8, 6, 6
    pool = torch.randn(2000, generator=g).to(dtype)
    w = PooledLora(pool, fin, fout, slots)
    for slot, rank in enumerate((1, 3, 0, 4, 2, 5)):
        if rank:
            w.point(slot, 100 * slot, 100 * slot + 50, rank, 0.5 + slot)
    block = tuple((slot, 2 * i, 2 * i + 2) for i, slot in enumerate((0, 1, 3, 4, 5, 1)))
    gapped = ((0, 0, 1), (-1, 1, 3), (3, 3, 5), (2, 5, 6), (4, 6, 7), (5, 7, 9), (0, 9, 10),
              (3, 10, 12))
    # the last: decodes around a prefill-sized gap (their span is mostly other rows)
    sparse = ((0, 0, 1), (1, 1, 2), (-1, 2, 40), (3, 40, 41), (4, 41, 42), (5, 42, 43))
    for runs in (block, gapped, gapped[1:], sparse):  # gapped[1:]: the span starts at row 3
        assert sum(1 for r in runs if w.adapts(r[0])) >= GROUPED_MIN_RUNS
        rows = runs[-1][2]
        x = torch.randn(rows + 3, fin, generator=g).to(dtype)[3:]  # not at the buffer front
        y = torch.randn(rows, fout + 2, generator=g).to(dtype)
        want = y.clone()
        for slot, lo, hi in runs:
            if w.adapts(slot):
                a, bt = w.a_views[slot], w.bt_views[slot]
                want[lo:hi, 2:] += (x[lo:hi] @ a.T) @ bt * w.host_scales[slot]
        for _ in range(2):  # the second call reuses the cached views
            got = y.clone()
            apply_runs(got, x, w, runs, out_offset=2)
            torch.testing.assert_close(got, want, **TOL[dtype])
            untouched = [r for slot, lo, hi in runs if not w.adapts(slot) for r in range(lo, hi)]
            assert torch.equal(got[untouched], y[untouched])
    w.point(3, 1500, 1550, 2, 3.0)  # re-pointing a slot drops its cached views
    got, want = y.clone(), y.clone()
    apply_runs(got, x, w, gapped, out_offset=2)
    for slot, lo, hi in gapped:
        if w.adapts(slot):
            a, bt = w.a_views[slot], w.bt_views[slot]
            want[lo:hi, 2:] += (x[lo:hi] @ a.T) @ bt * w.host_scales[slot]
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_small_shrinks_leave_onednn_as_they_found_it(dtype: torch.dtype) -> None:
    """Half-precision decode shrinks run without oneDNN (its per-call cost dwarfs a shrink
    of two rows); the switch is process-wide, so it is restored on the way out, failures
    included, and fp32 never touches it."""
    from loraplane_kernels.rank_pool import small_shrink_gemms

    assert torch._C._get_mkldnn_enabled()
    with small_shrink_gemms(dtype):
        assert torch._C._get_mkldnn_enabled() is (dtype == torch.float32)
    assert torch._C._get_mkldnn_enabled()
    with pytest.raises(RuntimeError), small_shrink_gemms(dtype):
        raise RuntimeError("a failing shrink")
    assert torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with small_shrink_gemms(dtype):
            assert not torch._C._get_mkldnn_enabled()
        assert not torch._C._get_mkldnn_enabled()  # off before, off after
    finally:
        torch._C._set_mkldnn_enabled(True)
