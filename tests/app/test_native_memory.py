"""The hold on glibc malloc: arenas capped by the CLI (what kept a long run's RSS creeping), the user's setting
first; the streamed engine's trims only once the resident set grows past a slack."""
import json
import os
import platform
import subprocess
import sys

import pytest

from helpers.procs import WORKERS
from zinf_jax._internal.native_memory import Trimmer, resident_bytes

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def _arenas(count, **env):
    p = subprocess.run([sys.executable, str(WORKERS / "arena_worker.py"), str(count)], capture_output=True, text=True,
                       env={**{k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}, **env}, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@glibc_only
def test_limit_arenas_caps_them_and_the_users_malloc_arena_max_wins():
    capped = _arenas(1)
    assert capped["set"] and capped["heaps"] == 1, capped
    users = _arenas(1, MALLOC_ARENA_MAX="3")  # the user's choice is left as it is: threads get up to 3
    assert not users["set"] and users["heaps"] == 3, users
    assert isinstance(capped["trimmed"], bool)


def test_trimmer_trims_once_the_resident_set_passes_its_low_by_the_slack():
    """Steady reuse (up and down within the slack) never trims; growth past the low by more than the slack
    trims once, and the low is read again after it."""
    rss, trims = [1000], []

    def release():
        trims.append(rss[0])
        rss[0] = 700  # what the trim handed back

    t = Trimmer(slack=100, resident=lambda: rss[0], release=release)
    for now in (1100, 1050, 1100, 1000, 1099):  # a unit's buffers freed and taken again
        rss[0] = now
        assert not t.check()
    rss[0] = 850  # lower: the low follows it down
    assert not t.check()
    rss[0] = 951  # 101 past the low of 850
    assert t.check() and trims == [951] and t.trims == 1
    rss[0] = 800  # 100 past the post-trim reading of 700: within the slack
    assert not t.check() and t.trims == 1
    assert resident_bytes() > 0 or not os.path.exists("/proc/self/statm")
