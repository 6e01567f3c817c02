"""Where each demo adapter's files are, training them only when no matching set exists.

The trained adapters are committed under `trained/`, each with a `training.json` that
records what it was trained from: the SHA-256 of the training data, of the code that
renders the replies and trains (`styles.py`, `training.py`), the adapter's plan and the
base model's digest, combined into one fingerprint, plus the digests of the adapter files
themselves. A committed adapter is used only while that record matches the current data,
code and base model; otherwise (or when asked) it is re-trained into the cache, once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.contracts.events import TenantRef

from .styles import QUESTIONS, HouseStyle, load_facts
from .tenants import DEMO_TENANTS, DemoTenant
from .training import TrainingStats, train

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).parent
TRAINED = PACKAGE / "trained"
RECORD = "training.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
INPUTS = (QUESTIONS, PACKAGE / "styles.py", PACKAGE / "training.py")
"""The files whose bytes decide what an adapter learns."""
BASE_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Written as the adapters' `base_model_name_or_path` (never the local directory)."""


@dataclass(frozen=True)
class DemoAdapter:
    """A demo adapter ready to publish: its files, owner, id and a question to ask it."""

    tenant: TenantRef
    adapter_id: str
    directory: Path
    """A standard PEFT directory (adapter_config.json + adapter_model.safetensors)."""
    question: str
    style: HouseStyle
    committed: bool
    """True for the files in the repository, False for a training in the cache."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def inputs_record(spec: DemoTenant, base_digest: str) -> dict[str, Any]:
    """Everything an adapter's weights depend on, by digest."""
    return {
        "files": {path.name: _sha256(path) for path in INPUTS},
        "adapter_id": spec.adapter_id,
        "style": spec.style.name,
        "plan": spec.plan.as_record(),
        "base_model_digest": base_digest,
    }


def fingerprint(spec: DemoTenant, base_digest: str) -> str:
    """One SHA-256 over `inputs_record`: equal fingerprints, same training."""
    text = json.dumps(inputs_record(spec, base_digest), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def mismatch(spec: DemoTenant, directory: Path, base_digest: str) -> str | None:
    """Why the adapter in `directory` is not `spec` trained on today's inputs, or None."""
    try:
        record = json.loads((directory / RECORD).read_text())
    except FileNotFoundError:
        return "not trained"
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable {RECORD}: {exc}"
    for name in ADAPTER_FILES:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != record.get("sha256", {}).get(name):
            return f"{name} does not match the digest in {RECORD}"
    if record.get("fingerprint") == fingerprint(spec, base_digest):
        return None
    now, then = inputs_record(spec, base_digest), record.get("inputs", {})
    changed = [k for k in now["files"] if now["files"][k] != then.get("files", {}).get(k)]
    changed += [k for k in now if k != "files" and now[k] != then.get(k)]
    return "trained from other inputs: " + ", ".join(changed or ["fingerprint"])


def cache_directory(cache_dir: Path, spec: DemoTenant, base_digest: str) -> Path:
    return cache_dir / "demo_adapters" / fingerprint(spec, base_digest)[:16] / spec.adapter_id


def load_base(base_model_dir: Path) -> tuple[Any, Any]:
    """The base model for training, in float32 (this CPU path has no native bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    return model, tokenizer


def train_into(directory: Path, spec: DemoTenant, base: tuple[Any, Any],
               base_digest: str, progress: Callable[[int, float], None] | None = None,
               ) -> TrainingStats:
    """Train `spec` and write its PEFT directory and record at `directory`, atomically:
    a reader sees the previous set or the new one, never half of one."""
    import peft
    import torch
    import transformers

    model, tokenizer = base
    peft_model, stats = train(model, tokenizer, spec.style, load_facts(), spec.plan,
                                 progress)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        peft_model.save_pretrained(tmp, save_embedding_layers=False)
        config_path = tmp / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = BASE_MODEL_NAME  # not this machine's path
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
        record = {
            "adapter_id": spec.adapter_id,
            "tenant": spec.tenant.key,
            "behaviour": spec.style.description,
            "fingerprint": fingerprint(spec, base_digest),
            "inputs": inputs_record(spec, base_digest),
            "sha256": {name: _sha256(tmp / name) for name in ADAPTER_FILES},
            "training": stats.as_record(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__},
        }
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(directory)
    finally:
        peft_model.unload()  # the base model, without LoRA layers, for the next adapter
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def demo_adapters(base_model_dir: str | Path, cache_dir: str | Path, *,
                  base_digest: str | None = None, retrain: bool = False,
                  tenants: Sequence[DemoTenant] = DEMO_TENANTS,
                  on_train: Callable[[DemoTenant, TrainingStats], None] | None = None,
                  ) -> list[DemoAdapter]:
    """Each demo tenant's adapter for the base model at `base_model_dir`.

    The committed files when they match today's data, code and base model; else a
    matching earlier training in `cache_dir`; else (and always when `retrain`) a new
    training into `cache_dir` (about a minute of CPU per adapter). `base_digest` is the
    model's `checkpoint_digest` when the caller has it already.
    """
    from services.worker.engine import checkpoint_digest

    base_dir = Path(base_model_dir)
    digest = base_digest or checkpoint_digest(base_dir)
    base: tuple[Any, Any] | None = None
    found = []
    for spec in tenants:
        committed = TRAINED / spec.adapter_id
        cached = cache_directory(Path(cache_dir), spec, digest)
        why = "re-training was asked for" if retrain else mismatch(spec, committed, digest)
        if why is None:
            directory = committed
        elif not retrain and mismatch(spec, cached, digest) is None:
            directory = cached
        else:
            log.info("training demo adapter %s into the cache: committed files %s",
                     spec.adapter_id, why)
            base = base or load_base(base_dir)
            stats = train_into(cached, spec, base, digest)
            if on_train is not None:
                on_train(spec, stats)
            directory = cached
        found.append(DemoAdapter(tenant=spec.tenant, adapter_id=spec.adapter_id,
                                 directory=directory, question=spec.question,
                                 style=spec.style, committed=directory == committed))
    return found
