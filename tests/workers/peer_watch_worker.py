"""One process of a 3-process job that only watches its peers (no training): process 2 dies at once.

Usage: python peer_watch_worker.py PROCESS_ID PORT CKPT_DIR
Each process joins with :func:`zinf_jax.distributed.initialize` (JAX's recoverable mode, a 2 s peer
timeout, the watch polling every 0.2 s) and waits; process 2 exits without a word once all have
joined (``os._exit``, as a crash would). The watch must end 0 and 1.
"""
import os
import sys
import time

pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["JAX_PLATFORMS"] = "cpu"

import zinf_jax as zinf  # noqa: E402

job = zinf.distributed.initialize(f"localhost:{port}", 3, pid, peer_timeout=2, checkpoint_dir=ckpt, poll_s=0.2)
with job:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("all published")
    if pid == 2:
        os._exit(9)
    time.sleep(60)
print("the watch never stopped this process", flush=True)
