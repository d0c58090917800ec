"""When to save: orbax's own save-decision policies, and the one place the main job's knobs become one.

zinf assembles its step directories itself, so no orbax ``CheckpointManager`` owns them; the
decision *when* to save is still orbax's: a
:class:`orbax.checkpoint.checkpoint_managers.SaveDecisionPolicy` (one ``should_save`` method;
``FixedIntervalPolicy``, ``SpecificStepsPolicy``, ``PreemptionCheckpointingPolicy``, combined
with ``AnySavePolicy``), asked through :func:`should_save` with zinf's step. Retention (which
checkpoints to keep) is orbax's ``LatestN`` likewise (:mod:`zinf_jax.checkpoint.retention`).
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Sequence

import orbax.checkpoint as ocp

__all__ = ["SaveDecisionPolicy", "StepInfo", "from_knobs", "should_save"]

SaveDecisionPolicy = ocp.checkpoint_managers.SaveDecisionPolicy
_cm = ocp.checkpoint_managers


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step (saved or about to be) as orbax's save-decision and preservation policies see it
    (their ``PolicyCheckpointInfo`` protocol)."""

    step: int
    time: datetime.datetime
    metrics: dict[str, Any] | None = None


def from_knobs(save_every: int, *, steps: Sequence[int] = ()) -> SaveDecisionPolicy:
    """The policy of the main job's flags: every ``save_every`` steps (0: never periodically), and at ``steps``.

    (The main job also saves at its end and after a stop signal, whatever the policy.)

    Args:
      save_every: checkpoint period in optimizer steps (``--save-every``); 0 turns the period off.
      steps: steps that are always saved (e.g. the last one).
    """
    policies: list[SaveDecisionPolicy] = []
    if save_every:
        policies.append(_cm.FixedIntervalPolicy(save_every))
    if steps:
        policies.append(_cm.SpecificStepsPolicy(tuple(steps)))
    return _cm.AnySavePolicy(policies)


def should_save(policy: SaveDecisionPolicy, step: int, *, preempted: bool = False) -> bool:
    """Asks ``policy`` whether optimizer step ``step`` (just applied) is saved.

    Args:
      policy: an orbax save-decision policy.
      step: the engine's step after the update.
      preempted: a stop was requested (SIGTERM/SIGINT): orbax's ``PreemptionCheckpointingPolicy`` says yes.
    """
    info = StepInfo(step=step, time=datetime.datetime.now())
    context = _cm.DecisionContext(is_saving_in_progress=False, reached_preemption=preempted,
                                  multiprocessing_options=ocp.options.MultiprocessingOptions())
    return bool(policy.should_save(info, (), context=context))
