"""Writes `schemas/events/*.json` from the event models (draft 2020-12).

Run `python -m services.contracts.schema_export` after changing a payload class; the
contract test fails until the files are regenerated and committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from services.contracts.codec import EVENT_SCHEMAS_DIR
from services.contracts.events import PAYLOAD_TYPES, Envelope, Payload, typed_envelope

DRAFT = "https://json-schema.org/draft/2020-12/schema"
BASE_ID = "https://loraplane.dev/schemas/events/"


def event_schema(cls: type[Payload]) -> dict[str, Any]:
    schema = typed_envelope(cls.event_type()).model_json_schema(mode="serialization")
    return {"$schema": DRAFT, "$id": f"{BASE_ID}{cls.event_type()}.json",
            "description": (cls.__doc__ or cls.event_type()).strip().splitlines()[0],
            "x-topic": cls.topic, **{k: v for k, v in schema.items() if k != "description"}}


def envelope_schema() -> dict[str, Any]:
    schema = Envelope.model_json_schema(mode="serialization")
    schema["properties"]["type"]["enum"] = sorted(PAYLOAD_TYPES)
    schema["properties"]["payload"] = {"type": "object"}
    schema.get("$defs", {}).pop("Payload", None)
    return {"$schema": DRAFT, "$id": f"{BASE_ID}envelope.json", **schema}


def rendered() -> dict[str, str]:
    """File name → exact text, for writing and for the drift test."""
    files = {"envelope.json": envelope_schema()}
    files.update({f"{name}.json": event_schema(cls) for name, cls in PAYLOAD_TYPES.items()})
    return {name: json.dumps(doc, indent=2, sort_keys=True) + "\n" for name, doc in files.items()}


def write(directory: Path = EVENT_SCHEMAS_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write():
        sys.stdout.write(f"wrote {path}\n")
