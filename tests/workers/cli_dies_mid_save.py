"""``zinf-jax train`` as one process of a job, which SIGKILLs itself in the middle of one checkpoint save.

Usage: python cli_dies_mid_save.py STEP TRAIN_ARGS...
In its save of step STEP the process writes its share of the arrays into the save's temporary
directory and then kills itself (SIGKILL: no handler runs, nothing is cleaned up), before the
checkpoint's metadata, checksums and rename: a host lost at the worst moment for a checkpoint.
The fault is injected here, in the test's worker, by wrapping the save's array writer.
"""
import importlib
import os
import signal
import sys

from zinf_jax.app import cli

save = importlib.import_module("zinf_jax.checkpoint.save")  # the module (the package exports its function)

die_at = int(sys.argv[1])
write_arrays = save._write_arrays


def write_then_die(view, tmp):
    write_arrays(view, tmp)
    if view.step == die_at:
        os.kill(os.getpid(), signal.SIGKILL)


save._write_arrays = write_then_die
if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:]))
