"""Keep the Triton interpreter out of the parent pytest session.

Triton decides at ``@triton.jit`` time (when ``loraplane_kernels.triton`` is imported) whether a
kernel is compiled or interpreted, from ``TRITON_INTERPRET``. Setting it here would leak into
every other test folder of the session (and interpret real GPU kernels on a GPU machine).
So the kernel tests live in ``interpreted/`` and run in a child pytest with
``TRITON_INTERPRET=1`` (see ``test_interpreted_kernels.py``). A session started with
``TRITON_INTERPRET=1`` already collects them directly instead, and skips the launcher, so
they never run twice.
"""

from __future__ import annotations

import os
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HERE = Path(__file__).parent


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if collection_path == HERE / "interpreted" and not INTERPRETED:
        return True
    if collection_path == HERE / "test_interpreted_kernels.py" and INTERPRETED:
        return True
    return None
