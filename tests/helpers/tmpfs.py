"""A small tmpfs for disk-full and read-only tests (mounting needs root: the test skips with the reason)."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted(path: Path, opts: str, *, must_release: bool = False) -> Iterator[Path]:
    """A tmpfs at ``path`` (created) with mount options ``opts`` for the block, unmounted after.

    Args:
      must_release: fail if it cannot be unmounted cleanly (busy: something under test left files open).
    """
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({opts}) at {path}: {(r.stderr or r.stdout).strip()} (needs root)")
    try:
        yield path
    finally:
        unmounted = subprocess.run(["umount", str(path)], capture_output=True).returncode == 0
        if not unmounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
    assert unmounted or not must_release, f"{path} still in use: the failed run did not release its nvme tier"
