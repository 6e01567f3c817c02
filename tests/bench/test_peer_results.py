"""The peer bench's summary and tables from recorded rounds: ratios per round, the greedy
parity per adapter and the matmul ceiling beside each batch workload."""

from __future__ import annotations

from bench import peer_llamacpp as peer


def rounds() -> list[dict]:
    def single(itl: float, ttft: float, tokens: list[int]) -> dict:
        return {"itl_median_ms": itl, "ttft_ms": ttft, "tokens": tokens, "load_after": 1.0,
                "server_ttft_ms": ttft, "server_itl_ms": itl}

    def batch(tok_s: float, tokens: list[list[int]], ceiling: float | None) -> dict:
        out = {"tok_s": tok_s, "seconds": 1.0, "tokens": tokens, "load_after": 1.0}
        if ceiling is not None:
            out["matmul_ceiling_tok_s"] = ceiling
            out["matmuls_alone_seconds"] = 0.5
        return out

    out = []
    for r, (eng, peer_rate) in enumerate(((300.0, 100.0), (320.0, 80.0))):
        out.append({"first": "engine" if r % 2 == 0 else "llama_server", **{
            work: {"engine": single(10.0 + r, 50.0, [1, 2]),
                   "llama_server": single(20.0, 100.0, [1, 2])}
            for work in ("single_base", "single_adapter")},
            "mix": {"engine": batch(eng, [[1], [2], [3], [4]], 2 * eng),
                    "llama_server": batch(peer_rate, [[1], [2], [0], [4]], None)},
            "base": {"engine": batch(eng, [[1]] * 4, 2 * eng),
                     "llama_server": batch(2 * peer_rate, [[1]] * 4, None)}})
    return out


def test_the_summary_keeps_the_ceiling_and_its_ratio_against_the_peer_per_round() -> None:
    mix = [{"adapter": i % 4} for i in range(4)]
    part = {"llama_server": {"base_gguf": "f32"}, "engine": "float32", "rounds": rounds()}
    peer.summarise(part, mix)
    tok = part["summary"]["mix"]["tok_s"]
    assert tok["ratio_per_round"] == [3.0, 4.0]
    assert tok["engine_matmul_ceiling"] == [600.0, 640.0]
    assert tok["ceiling_ratio_per_round"] == [6.0, 8.0]
    assert part["summary"]["mix"]["parity"] == {"base": "1/1", "adapter 1": "1/1",
                                                "adapter 2": "0/1", "adapter 3": "1/1"}
    assert all("tokens" not in side for r in part["rounds"] for w in r.values()
               if isinstance(w, dict) for side in w.values())
    result = {"runs": {"f32": part}}
    rows = {row[0]: row[1] for row in peer.tables(result)[0]["rows"]}
    assert rows[f"{peer.LABELS['mix']}: the engine's base matmuls alone, its ceiling "
                "(tok/s, per round)"] == "600.0/640.0 (6.00-8.00x the peer)"
    mix_figure = next(f for f in peer.figures(result) if f.name.startswith("f32: 32"))
    assert mix_figure.meets_target is False  # 3.5, against 6
    assert "would allow at most 6.00-8.00x" in mix_figure.settings
