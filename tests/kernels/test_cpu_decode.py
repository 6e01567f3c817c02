"""The compiled decode pass (`loraplane_kernels.cpu_decode`, bf16 and fp32) against the torch
path it replaces: the same ops and, in bf16, the same roundings, so the same values but for the
order of the fp32 accumulations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane_kernels import PooledLora, cpu_decode
from loraplane_kernels.int8 import quantize_int8
from loraplane_kernels.rank_pool import apply_runs, step_runs

pytest.importorskip("numba")

BLOCK = tuple((slot, 2 * i, 2 * i + 2) for i, slot in enumerate((0, 1, 3, 4, 5, 1)))
GAPPED = ((0, 0, 1), (-1, 1, 3), (3, 3, 5), (2, 5, 6), (4, 6, 7), (5, 7, 22), (0, 22, 23),
          (3, 23, 38))
"""Base rows, an unadapted slot, a repeat, and runs of 15 rows (the largest small run)."""
SPARSE = ((0, 0, 1), (1, 1, 2), (-1, 2, 40), (3, 40, 41), (4, 41, 42), (5, 42, 43))


def pooled(fin: int, fout: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> PooledLora:
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(100 * (fin + fout) + 40_000, generator=g) * 0.1).to(dtype)
    w = PooledLora(pool, fin, fout, 6)
    offset = 0
    for slot, rank in enumerate((1, 8, 0, 64, 3, 16)):
        if rank:
            w.point(slot, offset, offset + rank * fin, rank, (0.5, 2.0, 1.0, 0.25, 1.5, 4.0)[slot])
            offset += rank * (fin + fout) + 7  # odd offsets: no alignment assumed
    return w


def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the compiled pass's calls (so a silent fallback to torch cannot pass)."""
    calls: list[int] = []
    real = cpu_decode.apply_small_runs

    def counted(*args: object) -> None:
        calls.append(1)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_decode, "apply_small_runs", counted)
    return calls


def both_paths(w: PooledLora, runs: tuple[tuple[int, int, int], ...], x: torch.Tensor,
               y: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    calls = compiled_calls(monkeypatch)
    host = y.clone()
    apply_runs(host, x, w, runs, out_offset=3)
    assert calls  # the compiled pass ran, not a silent fallback
    with monkeypatch.context() as m:
        m.setattr("loraplane_kernels.rank_pool.HOST_PASS", False)
        torch_path = y.clone()
        apply_runs(torch_path, x, w, runs, out_offset=3)
    return host, torch_path


@pytest.mark.parametrize("runs", [BLOCK, GAPPED, SPARSE], ids=["block", "gapped", "sparse"])
@pytest.mark.parametrize(("fin", "fout"), [(64, 48), (576, 192), (96, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compiled_pass_lands_the_torch_paths_rows(
        runs: tuple[tuple[int, int, int], ...], fin: int, fout: int, dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = pooled(fin, fout, seed=fin + fout, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    rows = runs[-1][2]
    x = torch.randn(rows + 2, fin, generator=g).to(dtype)[2:]  # not at the buffer front
    y = torch.randn(rows, fout + 5, generator=g).to(dtype)
    host, torch_path = both_paths(w, runs, x, y, monkeypatch)
    adapted = [r for slot, lo, hi in runs if w.adapts(slot) for r in range(lo, hi)]
    assert not torch.equal(host[adapted], y[adapted])
    if dtype == torch.float32:
        torch.testing.assert_close(host, torch_path)
    else:  # one bf16 ulp at most, and rarely: only the order of fp32 accumulations differs.
        # The ulp is of the largest operand of the final add (y or its sum): where the
        # LoRA delta cancels most of y, the sum is small and its own ulp says nothing of
        # the rounding the operands carried (oneDNN's AMX path rounds x·A to bf16 first).
        diff = (host.float() - torch_path.float()).abs()
        ulp = torch.stack([host.float().abs(), torch_path.float().abs(),
                           y.float().abs()]).amax(0) * 2.0 ** -7
        assert bool((diff <= ulp).all())
        assert (diff > 0).float().mean().item() < 0.01
    untouched = [r for r in range(rows) if r not in adapted]
    assert torch.equal(host[untouched], y[untouched])
    assert torch.equal(host[:, :3], y[:, :3]) and torch.equal(host[:, 3 + fout:], y[:, 3 + fout:])


def test_a_nan_stays_in_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    w = pooled(64, 48, seed=3)
    x = torch.randn(12, 64).to(torch.bfloat16)
    x[4, 10] = float("nan")
    y = torch.zeros(12, 54, dtype=torch.bfloat16)
    host, torch_path = both_paths(w, BLOCK, x, y, monkeypatch)
    assert host[4, 3:51].isnan().all() and torch_path[4, 3:51].isnan().all()
    assert not host[torch.arange(12) != 4].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_split_serves_every_projection_and_a_repointed_slot_counts_at_once(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's runs are split once; each projection's slots are read in the kernel, so
    a projection that does not adapt a slot skips it, and re-pointing a slot (a new rank,
    or cleared) changes the very next call, with no per-projection arrays to go stale."""
    narrow, wide = pooled(64, 48, seed=3, dtype=dtype), pooled(64, 48, seed=4, dtype=dtype)
    wide.point(2, 35_000, 35_000 + 5 * 64, 5, 0.75)  # a slot only `wide` adapts
    runs = ((2, 0, 2), *BLOCK[1:])
    assert step_runs(runs) is step_runs(runs)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 64, generator=g).to(dtype)
    y = torch.randn(12, 54, generator=g).to(dtype)
    for w in (narrow, wide):
        host, torch_path = both_paths(w, runs, x, y, monkeypatch)
        assert torch.equal(host[:2], y[:2]) is (w is narrow)
        torch.testing.assert_close(host, torch_path, atol=0.05, rtol=0.02)
    wide.point(3, 30_000, 30_000 + 2 * 64, 2, 1.0)
    wide.unpoint(4)
    host, torch_path = both_paths(wide, runs, x, y, monkeypatch)
    torch.testing.assert_close(host, torch_path, atol=0.05, rtol=0.02)
    assert torch.equal(host[6:8], y[6:8])  # slot 4, cleared: untouched


def test_fp16_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = compiled_calls(monkeypatch)
    w = pooled(64, 48, seed=5, dtype=torch.float16)
    apply_runs(torch.zeros(12, 54, dtype=torch.float16), torch.randn(12, 64).half(), w, BLOCK, 3)
    assert not calls


@pytest.mark.parametrize("numba_threads", [True, False], ids=["numba-threads", "serial"])
@pytest.mark.parametrize("runs", [BLOCK, GAPPED, SPARSE], ids=["block", "gapped", "sparse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_thread_count_gives_the_same_bits(dtype: torch.dtype, runs, numba_threads: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run is computed whole by one thread, so how the runs are cut into shares (by
    rows x rank, over however many threads), or running them all on one thread, cannot
    change a bit; every row of every run is written."""
    monkeypatch.setattr(cpu_decode, "_PARALLEL", [numba_threads])
    cpu_decode._runs_shares.cache_clear()
    w = pooled(96, 160, seed=3, dtype=dtype)
    rows = max(r[2] for r in runs)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    y = torch.randn(rows, 170, generator=g).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            out = y.clone()
            apply_runs(out, x, w, runs, out_offset=3)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
        cpu_decode._runs_shares.cache_clear()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    adapted = [r for r in runs if r[0] >= 0 and w.host_ranks[r[0]] > 0]
    for _, lo, hi in adapted:
        assert not torch.equal(outs[0][lo:hi, 3:163], y[lo:hi, 3:163])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), fin=st.integers(1, 300), fout=st.integers(1, 200),
       biased=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       int8=st.booleans(), threads=st.sampled_from([1, 2, 3, 8]),
       seed=st.integers(0, 2**16))
def test_the_few_row_linear_is_torchs_up_to_the_order_of_its_sums(
        rows: int, fin: int, fout: int, biased: bool, dtype: torch.dtype, int8: bool,
        threads: int, seed: int) -> None:
    """`linear_rows` (one-row steps' projections) against the exact product, dense or over
    int8 weights (`int8_linear`'s reconstruction), rounded where the torch ops round:
    within a rounding of the exact value per rounding step plus the fp32 sums' slack;
    every thread count cuts the columns differently and gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, fin, generator=g).to(dtype)
    w = (torch.randn(fout, fin, generator=g) / fin**0.5).to(dtype)
    bias = torch.randn(fout, generator=g).to(dtype) if biased else None
    none = cpu_decode.as_array(torch.empty(0, dtype=dtype))
    if int8:
        q = quantize_int8(w)
        flat, scale = q.q.numpy().reshape(-1), cpu_decode.as_array(q.scale)
        w = q.q.double() * q.scale.double()[:, None]  # the exact reconstruction
    else:
        flat, scale = cpu_decode.as_array(w).reshape(-1), none
    exact = torch.nn.functional.linear(x.double(), w.double(),
                                       None if bias is None else bias.double())
    before = torch.get_num_threads()
    outs = []
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            outs.append(cpu_decode.linear_rows(
                x, flat, scale, none if bias is None else cpu_decode.as_array(bias),
                torch.full((rows, fout), float("nan"), dtype=dtype)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    eps = torch.finfo(dtype).eps * (2 if int8 and biased else 1)
    slack = (x.double().abs() @ w.double().abs().T) * (fin * 2**-23 * (1 + eps))
    if bias is not None:
        slack += bias.double().abs() * (2**-23 + eps)
    assert torch.all((outs[0].double() - exact).abs() <= exact.abs() * eps + slack + 1e-30)


def test_a_launch_without_a_threadsafe_layer_turns_every_kernel_serial(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """numba raises ValueError when a parallel kernel finds no thread-safe threading layer;
    `on_threads` then says so (the caller runs its serial kernel) and every kernel's
    shares are off from then on, where a second launch could abort the process."""
    monkeypatch.setattr(cpu_decode, "_PARALLEL", [True])
    launched: list[tuple] = []

    def shared(*args: object) -> None:
        launched.append(args)
        raise ValueError("No threading layer could be loaded.")

    try:
        assert cpu_decode.on_threads(shared, 1, 2) is False
        assert launched == [(1, 2)]
        assert not cpu_decode.threadsafe()
        assert cpu_decode._linear_shares() is None and cpu_decode._runs_shares() is None
        assert cpu_decode.on_threads(None, 1) is False
        ran: list[int] = []
        assert cpu_decode.on_threads(lambda *a: ran.append(len(a)), 1, 2, 3) is True
        assert ran == [3]
    finally:
        monkeypatch.undo()
        for getter in (cpu_decode._shares, cpu_decode._runs_shares, cpu_decode._linear_shares,
                       cpu_decode._dequantize_shares):
            getter.cache_clear()
