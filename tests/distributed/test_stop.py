"""StopAgreement in one process: a signal is recorded, never raised, and is the agreed stop itself."""
import os
import signal
import subprocess
import sys

import pytest

import zinf_jax as zinf
from zinf_jax.errors import Interrupted


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_is_recorded_and_reached_at_the_next_step(sig):
    before = signal.getsignal(sig)
    with zinf.distributed.StopAgreement(fd=None) as stop:
        assert not stop.reached(1) and not stop.requested and stop.exit_code == 0
        os.kill(os.getpid(), sig)  # the handler only records it: nothing is raised here
        assert stop.requested and stop.name == signal.Signals(sig).name and stop.exit_code == 128 + sig
        assert stop.take_notice().strip().startswith(f"{stop.name}: stopping after the current step")
        assert stop.take_notice() is None  # once
        assert stop.reached(2) and stop.reached(3)  # stays True
        with pytest.raises(Interrupted, match="during startup: nothing trained"):
            stop.check("startup")
    assert signal.getsignal(sig) is before  # the previous handler is back


def test_a_second_signal_aborts_at_once(tmp_path):
    script = ("import os, signal, time, zinf_jax as zinf\n"
              "stop = zinf.distributed.StopAgreement()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(5)\nprint('not aborted')\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130 and "not aborted" not in p.stdout
    assert "SIGINT again: aborting at once; the last checkpoint is intact" in p.stderr


def test_importing_it_loads_no_jax():
    """A program can install the handlers before JAX starts (the CLI does)."""
    script = "import sys, zinf_jax as zinf\nzinf.distributed.StopAgreement()\nprint('jax' in sys.modules)\n"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "False", p.stderr[-1500:]
