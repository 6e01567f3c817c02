"""The compiled decode attention (`loraplane_kernels.cpu_decode.decode_attention`) against the
torch path it replaces, inside `paged_attention`'s mixed steps: same rows, same values but
for the order of fp32 accumulations (fp32) or the torch path's bf16 roundings of scores and
probabilities (bf16, where the kernel rounds only its output)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from loraplane_kernels import cpu_decode
from services.worker.engine import attention
from services.worker.engine.attention import AttentionMetadata, PrefillSpan, paged_attention
from services.worker.engine.workspace import Workspace

pytest.importorskip("numba")


def step(lens: list[int], prefill: list[int], heads: int, kv_heads: int, block: int,
         dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A step of decodes with context `lens` interleaved with prefill chunks (no prefix):
    q [T, H, D], the new K/V, caches whose blocks are scattered, and the decode layout."""
    g = torch.Generator().manual_seed(seed)
    dim = 16
    blocks = sum(-(-n // block) for n in lens) + 3
    order = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block)
        tables.append(order[used:used + need])
        used += need
    k_cache = torch.randn(kv_heads, blocks * block, dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, blocks * block, dim, generator=g).to(dtype)
    rows, spans, t = [], [], 0
    for i in range(max(len(lens), len(prefill))):
        if i < len(prefill):
            spans.append((t, prefill[i]))
            t += prefill[i]
        if i < len(lens):
            rows.append(t)
            t += 1
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    k_new = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    v_new = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    return q, k_new, v_new, k_cache, v_cache, rows, tables, spans


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, rows: list[int], tables: list[list[int]], lens: list[int],
           spans: list[tuple[int, int]], block: int) -> tuple[torch.Tensor, AttentionMetadata]:
    meta = AttentionMetadata(prefills=[PrefillSpan(row_start=r, q_len=n, prefix_len=0)
                                       for r, n in spans])
    meta.finalize(rows, tables, lens, block, q.dtype)
    ws = Workspace(q.dtype, torch.device("cpu"))
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta,
                          1 / math.sqrt(q.shape[-1]), workspace=ws)
    return out.clone(), meta


def both_paths(monkeypatch: pytest.MonkeyPatch, *args: object) -> tuple[torch.Tensor, ...]:
    kernel, meta = attend(*args)
    assert meta.host_decodes is not None and not meta.decodes  # the kernel ran
    with monkeypatch.context() as m:
        m.setattr(attention, "HOST_DECODE", False)
        torch_path, torch_meta = attend(*args)
    assert torch_meta.host_decodes is None and torch_meta.decodes
    return kernel, torch_path


LENS = [2, 1, 17, 64, 5, 300, 33, 16, 15, 129] * 2
PREFILL = [3, 7, 1]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2)],
                         ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("block", [4, 16])
def test_fp32_decodes_match_the_torch_path_and_prefill_rows_are_untouched(
        heads: int, kv_heads: int, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k_new, v_new, k_cache, v_cache, rows, tables, spans = step(
        LENS, PREFILL, heads, kv_heads, block, torch.float32, seed=heads + block)
    kernel, torch_path = both_paths(monkeypatch, q, k_new, v_new, k_cache, v_cache, rows,
                                    tables, LENS, spans, block)
    torch.testing.assert_close(kernel[rows], torch_path[rows])
    prefill_rows = [r for lo, n in spans for r in range(lo, lo + n)]
    assert torch.equal(kernel[prefill_rows], torch_path[prefill_rows])


def exact(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row: int,
          table: list[int], n: int, block: int) -> torch.Tensor:
    """One decode's attention in fp64 from the same (bf16) inputs."""
    slots = [table[p // block] * block + p % block for p in range(n)]
    group = q.shape[1] // k_cache.shape[0]
    k = k_cache[:, slots].double().repeat_interleave(group, 0)  # [H, n, D]
    v = v_cache[:, slots].double().repeat_interleave(group, 0)
    s = (q[row].double()[:, None, :] @ k.transpose(1, 2))[:, 0] / math.sqrt(q.shape[-1])
    return (torch.softmax(s, -1)[:, None, :] @ v)[:, 0]


def test_bf16_decodes_are_the_exact_result_rounded_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    block = 16
    q, k_new, v_new, k_cache, v_cache, rows, tables, spans = step(
        LENS, PREFILL, 9, 3, block, torch.bfloat16, seed=5)
    kernel, torch_path = both_paths(monkeypatch, q, k_new, v_new, k_cache, v_cache, rows,
                                    tables, LENS, spans, block)
    kernel_err, torch_err = 0.0, 0.0
    for row, table, n in zip(rows, tables, LENS, strict=True):
        want = exact(q, k_cache, v_cache, row, table, n, block)
        err = (kernel[row].double() - want).abs()
        assert (err <= want.abs() * 2.0 ** -8 + 1e-6).all()  # within one bf16 rounding
        kernel_err = max(kernel_err, err.max().item())
        torch_err = max(torch_err, (torch_path[row].double() - want).abs().max().item())
    assert kernel_err <= torch_err  # fp32 scores and probabilities: never worse


@pytest.mark.parametrize("numba_threads", [True, False], ids=["numba-threads", "helpers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_thread_count_gives_the_same_bits(dtype: torch.dtype, numba_threads: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode is computed whole by one thread, so how a step is cut, and whether the
    shares run on numba's threads or on the Python helper threads, cannot change it."""
    monkeypatch.setattr(cpu_decode, "_PARALLEL", [numba_threads])
    cpu_decode._shares.cache_clear()
    block = 16
    q, k_new, v_new, k_cache, v_cache, rows, tables, spans = step(
        LENS, PREFILL, 9, 3, block, dtype, seed=11)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(attend(q, k_new, v_new, k_cache, v_cache, rows, tables, LENS, spans,
                               block)[0])
    finally:
        torch.set_num_threads(threads)
        cpu_decode._shares.cache_clear()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_shares_cover_every_decode_once_balanced_by_context() -> None:
    lens = [700, 3, 3, 3, 400, 400, 2, 90, 1, 650]
    plan = cpu_decode.DecodePlan(range(10), [[0] * 44] * 10, lens, 16)
    for threads in (1, 2, 3, 4, 16):
        cuts = plan.cuts(threads)
        assert cuts[0] == 0 and cuts[-1] == len(lens) and cuts == sorted(set(cuts))
        assert len(cuts) - 1 <= threads
        shares = [sum(lens[lo:hi]) for lo, hi in itertools.pairwise(cuts)]
        assert max(shares) <= sum(lens) / (len(cuts) - 1) + max(lens)
    assert plan.tables.shape == (10, 44) and plan.rows.dtype == np.int64


def test_a_nan_in_one_context_stays_in_that_decode() -> None:
    block = 4
    q, k_new, v_new, k_cache, v_cache, rows, tables, spans = step(
        LENS, [], 4, 2, block, torch.float32, seed=3)
    poisoned = 5  # the 300-token context
    k_cache[:, tables[poisoned][2] * block + 1] = float("nan")
    out = attend(q, k_new, v_new, k_cache, v_cache, rows, tables, LENS, spans, block)[0]
    assert out[rows[poisoned]].isnan().all()
    assert not out[[r for i, r in enumerate(rows) if i != poisoned]].isnan().any()


def test_the_vectorisable_exp_is_within_one_ulp() -> None:
    import numba

    from loraplane_kernels._cpu_decode_numba import exp_nonpositive

    @numba.njit
    def exps(x: np.ndarray, y: np.ndarray) -> None:
        for i in range(x.shape[0]):
            y[i] = exp_nonpositive(x[i])

    x = np.concatenate([-np.linspace(0, 87.3, 400_001, dtype=np.float32),
                        np.array([-0.0, -1e-30, -1e-7], dtype=np.float32)])
    y = np.empty_like(x)
    exps(x, y)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(y - want) <= ulp).all()
    edge = np.array([-88.0, -1e4, np.nan], dtype=np.float32)
    out = np.empty_like(edge)
    exps(edge, out)
    tiny = np.finfo(np.float32).tiny
    assert out[0] == out[1] and tiny <= out[0] < 1.001 * tiny and np.isnan(out[2])


def test_fp16_and_other_devices_keep_the_torch_path() -> None:
    meta = AttentionMetadata()
    meta.finalize([0], [[0]], [3], 4, torch.float16)
    assert meta.host_decodes is None and meta.decodes
    meta = AttentionMetadata()
    meta.finalize([0], [[0]], [3], 4, torch.float32, device=torch.device("meta"))
    assert meta.host_decodes is None and meta.decodes


@pytest.mark.parametrize(("window", "softcap"), [(8, None), (None, 2.0), (5, 3.0)],
                         ids=["window", "softcap", "both"])
def test_windows_and_softcapping_match_the_torch_path_and_the_definition(
        window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sliding-window layer's decodes see their last `window` positions only, even with
    the blocks before them freed (-1 in the table); soft-capped scores are cap * tanh(s /
    cap). The compiled kernel, the torch path and a direct fp64 computation agree."""
    block, lens = 4, [2, 1, 17, 64, 5, 33, 16, 15]
    q, k_new, v_new, k_cache, v_cache, rows, tables, _ = step(
        lens, [], 4, 2, block, torch.float32, seed=21)
    if window is not None:  # free the blocks wholly before each decode's window
        tables = [[-1 if (j + 1) * block <= n - window else b for j, b in enumerate(t)]
                  for t, n in zip(tables, lens, strict=True)]

    def run(host_decode: bool) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setattr(attention, "HOST_DECODE", host_decode)
            meta = AttentionMetadata()
            meta.finalize(rows, tables, lens, block, q.dtype)
            assert (meta.host_decodes is not None) == host_decode
            return paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 0.25,
                                   window=window, softcap=softcap).clone()

    kernel, torch_path = run(True), run(False)
    torch.testing.assert_close(kernel[rows], torch_path[rows])
    for row, table, n in zip(rows, tables, lens, strict=True):
        first = max(0, n - window) if window else 0
        slots = [table[p // block] * block + p % block for p in range(first, n)]
        k = k_cache[:, slots].double().repeat_interleave(2, 0)
        v = v_cache[:, slots].double().repeat_interleave(2, 0)
        s = (q[row].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * 0.25
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        want = (torch.softmax(s, -1)[:, None, :] @ v)[:, 0]
        torch.testing.assert_close(kernel[row].double(), want, atol=1e-5, rtol=1e-5)
