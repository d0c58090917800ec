"""The CLI's hold on glibc malloc: arenas capped (what kept a long run's RSS creeping), the user's setting first."""
import json
import os
import platform
import subprocess
import sys

import pytest

from helpers.procs import WORKERS

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def _arenas(count, **env):
    p = subprocess.run([sys.executable, str(WORKERS / "arena_worker.py"), str(count)], capture_output=True, text=True,
                       env={**{k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}, **env}, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_limit_arenas_caps_them_and_the_users_malloc_arena_max_wins():
    capped = _arenas(1)
    assert capped["set"] and capped["heaps"] == 1, capped
    users = _arenas(1, MALLOC_ARENA_MAX="3")  # the user's choice is left as it is: threads get up to 3
    assert not users["set"] and users["heaps"] == 3, users
    assert isinstance(capped["trimmed"], bool)
