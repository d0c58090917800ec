"""One process of a 3-process job that only watches its peers (no training): process 2 dies at once.

Usage: python peer_watch_worker.py PROCESS_ID PORT CKPT_DIR
Processes 0 and 1 join the job the way ``zinf-jax train`` does (JAX's recoverable mode, a 2 s
heartbeat timeout), run a :class:`~zinf_jax.app.peers.PeerWatch` and wait; process 2 joins, publishes
itself and exits without a word (``os._exit``, as a crash would). The watch must end 0 and 1.
"""
import os
import sys
import time

pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["JAX_PLATFORMS"] = "cpu"

from zinf_jax.app.job import start  # noqa: E402
from zinf_jax.app.peers import PeerWatch, last_checkpoint_phrase  # noqa: E402

start(f"localhost:{port}", 3, pid, peer_timeout=2)
with PeerWatch(3, pid, 2, lambda: last_checkpoint_phrase(ckpt, 3), poll_s=0.2) as watch:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("all published")
    if pid == 2:
        os._exit(9)
    time.sleep(60)
print("the watch never stopped this process", flush=True)
