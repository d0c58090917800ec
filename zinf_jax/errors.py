"""Every exception zinf_jax raises on purpose, under one base: :class:`ZinfError`.

Standard library only (the CLI imports it before JAX loads). Each class keeps
the built-in base it always had (``ValueError`` for bad input, ``RuntimeError``
for a state that cannot go on), so ``except ValueError`` in old code still
catches a :class:`ConfigError`; ``except zinf.ZinfError`` catches them all.
The modules that raise them re-export them under their old names
(``zinf_jax.config.ConfigError``, ``zinf_jax.tiers.TierError``, ...).

=========================== =========================================  ============
class                       raised when                                CLI exit
=========================== =========================================  ============
:class:`ConfigError`        a setting is missing, mistyped, out of     2
                            range, or conflicts with another
:class:`UnitPolicyError`    a unit holds parameters that are           2
                            inconsistent (persistent and not)
:class:`ParamMismatchError` pretrained values or a tier's contents do  2
                            not match the model
:class:`TierError`          a tier cannot do what was asked (path,     2
                            lock, disk full, unknown key)
:class:`TierDataError`      a tier's committed state is damaged or     2
                            half-updated
:class:`CheckpointError`    a checkpoint is missing, damaged, of       2
                            another model, or cannot be written
:class:`EngineError`        the engine is used in a way it cannot      2
                            support (after close, under ``jit``)
:class:`RunDirError`        the main job's run directory is in use or  2
                            holds another run
:class:`DistributedError`   a multi-process job cannot be joined, or   2
                            left in order
:class:`NonFiniteLossError` the main job ended with a non-finite loss  1
:class:`Interrupted`        a signal stopped the main job before it    128 + signal
                            had anything to save
=========================== =========================================  ============
"""
from __future__ import annotations

import signal

__all__ = ["ZinfError", "ConfigError", "UnitPolicyError", "ParamMismatchError", "TierError", "TierDataError",
           "CheckpointError", "EngineError", "RunDirError", "DistributedError", "NonFiniteLossError", "Interrupted"]


class ZinfError(Exception):
    """Base of every exception zinf_jax raises on purpose; its message names the problem and the fix."""


class ConfigError(ZinfError, ValueError):
    """A config value is missing, of the wrong type or out of range (``field`` at fault, if any).

    Attributes:
      field: the config field (dotted, as the file spells it) at fault, or None.
      detail: the message without the field's name.
    """

    def __init__(self, message: str, *, field: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.field, self.detail = field, (message if detail is None else detail)


class UnitPolicyError(ZinfError, ValueError):
    """The unit policy is inconsistent: a unit holds persistent parameters and others."""


class ParamMismatchError(ZinfError, ValueError):
    """The model's parameters do not match what the tier already stores (or the pretrained values given)."""


class TierError(ZinfError, RuntimeError):
    """A tier cannot do what was asked (bad path, lock held, disk full, unknown key)."""


class TierDataError(TierError):
    """A tier's committed state is damaged: a checksum mismatch, a missing file, an unreadable manifest.

    The state cannot be used; it must be restored from a checkpoint (into an empty directory).
    """


class CheckpointError(ZinfError, ValueError):
    """A checkpoint is missing, incomplete, damaged, or of another model; the message names the file."""


class EngineError(ZinfError, RuntimeError):
    """The engine, or a wrapped model, was used in a way it cannot support."""


class RunDirError(ZinfError, ValueError):
    """The main job's run directory is in use, or holds another run's state."""


class DistributedError(ZinfError, RuntimeError):
    """A multi-process job cannot be joined (coordinator unreachable, a peer never came) or left in order, or
    its preemption service is off (``zinf_jax.distributed``)."""


class NonFiniteLossError(ZinfError, RuntimeError):
    """The run ended with a non-finite loss (diverged, or a corrupt state); the exit status is 1."""


class Interrupted(ZinfError):
    """A stop was requested before the job had anything to save.

    Attributes:
      signum: the signal received.
      exit_code: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP).
    """

    def __init__(self, signum: int, where: str):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} during {where}: nothing trained, nothing saved")
