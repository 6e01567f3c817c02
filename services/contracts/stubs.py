"""Generation of the checked-in gRPC stubs from `schemas/proto/inference.proto`.

`python -m services.contracts.stubs` regenerates them; a test regenerates into a temporary
folder and compares bytes, so the checked-in stubs are always current.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from services.contracts.codec import SCHEMAS_DIR

PROTO_DIR = SCHEMAS_DIR / "proto"
STUBS_DIR = Path(__file__).resolve().parent / "grpc"
PROTOS = ("inference.proto",)


def generate(out_dir: Path) -> dict[str, bytes]:
    """Run protoc (grpcio-tools, a test/dev dependency) and return file name → bytes."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    files = {}
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        # protoc writes top-level imports; the stubs live inside a package.
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        files[path.name] = text.encode()
    return files


def write() -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
    written = []
    for name, data in files.items():
        (STUBS_DIR / name).write_bytes(data)
        written.append(STUBS_DIR / name)
    return written


if __name__ == "__main__":
    for path in write():
        sys.stdout.write(f"wrote {path}\n")
