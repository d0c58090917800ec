"""Caps glibc's malloc arenas (zinf_jax._internal.native_memory.limit_arenas), then lets 8 threads allocate.

Usage: python arena_worker.py COUNT
Prints one JSON line: {"set": whether the cap was set, "heaps": arenas glibc reports (malloc_info),
"trimmed": what trim() returned}.
"""
import ctypes
import json
import os
import sys
import tempfile
import threading

from zinf_jax._internal import native_memory

was_set = native_memory.limit_arenas(int(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(8)
held = []


def allocate():
    barrier.wait()  # all at once: glibc gives a contended thread an arena of its own (if it may)
    held.extend(libc.malloc(256) for _ in range(2000))


threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.TemporaryFile() as f:
    libc.fdopen.restype = ctypes.c_void_p
    stream = ctypes.c_void_p(libc.fdopen(os.dup(f.fileno()), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    f.seek(0)
    heaps = f.read().decode().count("<heap nr=")
print(json.dumps({"set": was_set, "heaps": heaps, "trimmed": native_memory.trim()}), flush=True)
