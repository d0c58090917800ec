"""The main job: train the bundled GPT on CPython's help text with tiered offload.

Parameters and optimizer state live on the nvme tier under ``--nvme-dir`` by
default; a live progress line shows step, loss, tokens/s and bytes per tier;
metrics go to a JSON-lines log; checkpoints are saved every ``save_every``
steps, at the end, and on SIGINT/SIGTERM/SIGHUP; ``resume`` continues from the
newest good one and reproduces the uninterrupted run bitwise (the batch of a
data position is a pure function of it; the data position, the RNG state and
the loss scaler are in the checkpoint). In a multi-process job the library's
:mod:`zinf_jax.distributed` watches the peers and turns a signal to any one
process into one step at which all stop.

The run directory is locked for the whole run, never silently reused (see
:mod:`zinf_jax.app.rundir`), and signals only request a stop at a safe point (see
:mod:`zinf_jax.distributed.stop`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from flax import nnx

from zinf_jax._internal import native_memory
from zinf_jax.api import Engine, close_quietly, initialize, restore
from zinf_jax.app import rundir
from zinf_jax.app.checks import check_args, check_batch
from zinf_jax.app.job import Job
from zinf_jax.app.metrics import MetricsLog
from zinf_jax.app.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.app.progress import Progress, engine_log
from zinf_jax.checkpoint import policies
from zinf_jax.checkpoint.format import META, is_complete
from zinf_jax.config import ZeroConfig
from zinf_jax.distributed import StopAgreement, current
from zinf_jax.errors import CheckpointError, ConfigError, DistributedError, Interrupted, NonFiniteLossError, TierError
from zinf_jax.optim import adamw

__all__ = ["TrainArgs", "train", "build_config", "check_args", "Interrupted", "NonFiniteLossError",
           "MAX_NONFINITE_IN_A_ROW"]

PROFILE_STEPS = range(1, 4)
"""Steps of a run (0-based, in this invocation) that ``--profile`` traces: after the first step's compiles."""

MAX_NONFINITE_IN_A_ROW = 10
"""Consecutive steps with a non-finite loss after which the job stops (they change nothing: they are skipped)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """Settings of the main job (each is a ``zinf-jax train`` flag).

    Two counters: the *step* is the number of optimizer updates applied
    (``Engine.step``; a step skipped for a non-finite gradient, e.g. an fp16
    overflow, does not count), the *data position* is the number of batches
    consumed (skipped steps included). ``steps``, ``save_every``, the
    checkpoint names ``step_<N>``, the progress line and the learning-rate
    schedule all follow the step; the data position is stored with each
    checkpoint (``user_state["data_step"]``) and a resumed run continues from it.

    Attributes:
      steps: optimizer steps to reach (a resumed run continues up to it).
      batch: sequences per step (split over the mesh: a multiple of the device count).
      seq: tokens per sequence.
      d_model: model width.
      n_layers: transformer blocks.
      n_heads: attention heads (they divide ``d_model``).
      lr: peak learning rate of AdamW (linear warmup, then cosine decay).
      warmup: steps of the linear learning-rate warmup.
      weight_decay: AdamW's decoupled weight decay.
      clip: clip gradients to this global norm (0: no clipping).
      run_dir: where the metrics log, checkpoints and (default) nvme tiers go.
      nvme_dir: directory of the nvme tiers (default ``<run_dir>/nvme``).
      param_device: tier of the parameters between uses (``none``: device memory, ``cpu``, ``nvme``).
      optimizer_device: tier of the fp32 master and the Adam states (``none``, ``cpu``, ``nvme``).
      engine: ``auto`` (compiled where the params are in device or host memory, streamed for nvme),
        ``compiled`` (one XLA program per step; param tier none or cpu) or ``streamed``.
      moments_dtype: storage of the Adam moments: ``float32``, or ``bfloat16`` (half their bytes on disk
        and in each step's I/O; float32 arithmetic, rounded to nearest even when stored).
      optimizer_update: ``host`` (the streamed CPU update of an optimizer on cpu or nvme) or ``device`` (that
        state moved to the devices and updated in the step's program; needs ``--param-device none``).
      nvme_update: ``in_place`` (one copy on disk; a step killed half-way is rebuilt from the
        checkpoint by ``resume``) or ``double_slot`` (every step durable, twice the disk).
      save_every: checkpoint period in steps (0: only at the end and on a signal).
      keep: keep the newest N checkpoints, deleting older ones after each save; 0 keeps all.
      resume: continue from the newest good checkpoint in ``<run_dir>/ckpt``.
      overwrite: delete the run dir's checkpoints, tier state and logs, then start over
        (without it, or ``resume``, a run dir that holds them is refused).
      config: a zinf config JSON (``ZeroConfig.to_dict`` form); flags given explicitly override it.
      deepspeed_config: a DeepSpeed JSON config (stage 3), or an accelerate YAML (``.yaml``) with a DeepSpeed
        section, instead: its ``"auto"`` values are filled from the flags (as the Hugging Face integration
        fills them from the Trainer's arguments), flags given explicitly override it, and the settings
        resolved are printed with their sources (:mod:`zinf_jax.app.settings`).
      compute_dtype: ``float32``, ``bfloat16`` or ``float16`` (with loss scaling); default: float32 on CPU,
        bfloat16 on GPU/TPU.
      gradient_accumulation_steps: micro-batches per optimizer step (the batch is split into this many).
      seed: initialisation and data seed.
      persistence_threshold: parameters with at most this many elements are not
        sharded (small, so that the demo model's blocks really are partitioned).
      progress: show progress: a live line on a terminal; under a pipe or in a log file, one plain
        line every ``log_every`` steps (and for the last).
      log_every: steps between plain progress lines when the output is not a terminal.
      tensorboard: also write the metrics as TensorBoard scalars to this directory (needs
        tensorboardX: ``pip install 'zinf-jax[tensorboard]'``).
      profile: a directory to write a profiler trace of steps 2-4 of this run
        to (TensorBoard / Perfetto; the engine's ``zinf/...`` regions show
        fetches, unit forward/backward, gradients out, optimizer read/update/write).
      coordinator: ``HOST:PORT`` of process 0 in a multi-process job (``jax.distributed``; every
        process gives the same), or ``auto`` (JAX reads the cluster's environment: SLURM, a TPU VM).
        Process 0 writes the progress, ``metrics.jsonl`` and ``summary.json``; every other process
        logs to ``<run_dir>/logs/process_<I>.log``. ``--batch`` is the whole job's; each process
        feeds its share of the rows.
      num_processes: processes in the job (with ``coordinator``).
      process_id: this process's index, 0 to ``num_processes - 1`` (with ``coordinator``).
      peer_timeout: seconds until a lost process (killed, out of memory, crashed) stops the job's
        others: JAX's heartbeat timeout (``jax.distributed``); they exit 75 with one line naming the
        lost process and the last complete checkpoint (:mod:`zinf_jax.distributed.peers`); restart every
        process with ``--resume``.
    """

    steps: int = 150
    batch: int = 16
    seq: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    run_dir: str = "runs/gpt"
    nvme_dir: str | None = None
    param_device: str = "nvme"
    optimizer_device: str = "nvme"
    engine: str = "auto"
    moments_dtype: str = "float32"
    optimizer_update: str = "host"
    nvme_update: str = "in_place"
    save_every: int = 50
    keep: int = 0
    resume: bool = False
    overwrite: bool = False
    config: str | None = None
    deepspeed_config: str | None = None
    compute_dtype: str | None = None
    gradient_accumulation_steps: int = 1
    seed: int = 0
    persistence_threshold: int = 1024
    progress: bool = True
    log_every: int = 10
    tensorboard: str | None = None
    profile: str | None = None
    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    peer_timeout: int = 60


def build_config(args: TrainArgs, given: frozenset[str] | None = None) -> ZeroConfig:
    """The ZeroConfig the flags (or the given config file, with the flags given over it) describe (creates nothing).

    See :func:`zinf_jax.app.settings.resolve`, which also returns the flags as the run uses them.
    """
    from zinf_jax.app.settings import resolve

    return resolve(args, given)[1]


def _nvme_paths(args: TrainArgs, config: ZeroConfig) -> list[str]:
    return [off.path for off in (config.offload_param, config.offload_optimizer) if off.device == "nvme"]


def _make_tier_dirs(args: TrainArgs, config: ZeroConfig) -> None:
    """Creates the job's own nvme directories (``--nvme-dir``, the default one, or a relative swap folder of a config)."""
    own = (args.nvme_dir, os.path.join(args.run_dir, "nvme"))
    for path in _nvme_paths(args, config):
        if not (args.config or args.deepspeed_config) or not os.path.isabs(path) or path in own:
            os.makedirs(path, exist_ok=True)


def _engine_kwargs(args: TrainArgs, config: ZeroConfig) -> tuple[Any, dict[str, Any]]:
    """The model constructor and the engine's keyword arguments.

    The flags' AdamW (warmup, then cosine decay) unless the config has an
    ``optimizer`` section (a DeepSpeed config's), which is then used as it is.
    Gradient clipping is the config's ``gradient_clipping`` (``--clip`` without a config file).
    """
    import optax

    cfg = GPTConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, seq=args.seq)
    seed = config.seed
    ctor = lambda: GPT(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    opt = None
    if config.optimizer is None:
        sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                   args.lr * 0.1)
        opt = adamw(sched, weight_decay=args.weight_decay)
    return ctor, dict(config=config, optimizer=opt, loss_fn=lm_loss)


_NOT_THE_CHECKPOINT = (TierError, ConfigError)  # errors of this job's setup, the same for every checkpoint


def _restore_newest_good(ckpt: Path, args: TrainArgs, config: ZeroConfig, out: TextIO,
                         job: Job) -> tuple[Engine, Path]:
    """Restores the newest checkpoint that restores; damaged newer ones are set aside, each with one line.

    The tier state is rebuilt from the checkpoint (cleared before each try: each process its own part).
    Process 0 sets the damaged ones aside.

    Raises:
      CheckpointError: none restores (the message names each one and why).
    """
    dirs = rundir.step_dirs(ckpt)
    if not dirs:
        raise CheckpointError(f"no zinf_jax checkpoint in {str(ckpt)!r} (expected step_<N>/{META}) to --resume from "
                              "(a run that stopped before its first checkpoint leaves none): pass --overwrite instead of "
                              "--resume to delete what it left and start over")
    ctor, kw = _engine_kwargs(args, config)
    bad: list[tuple[Path, str]] = []
    for d in dirs:
        if not is_complete(d):
            bad.append((d, f"no {META} (an interrupted or damaged save)"))
            continue
        rundir.clear_tier_state(_nvme_paths(args, config), process=job.index if job.count > 1 else None)
        _make_tier_dirs(args, config)
        try:
            engine = restore(d, ctor, **kw)
        except _NOT_THE_CHECKPOINT:
            raise
        except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
            bad.append((d, f"{type(e).__name__}: {e}"))
            continue
        for b, why in bad:
            moved = rundir.set_aside(b) if job.primary else None
            out.write(f"zinf-jax train: checkpoint {b.name} is unusable ({why}); resuming from {d.name} instead" +
                      (f" (the bad one is moved to {moved.name})\n" if moved else "\n"))
        return engine, d
    raise CheckpointError(f"no usable checkpoint in {str(ckpt)!r}: " + "; ".join(f"{b.name}: {w}" for b, w in bad))


def _tier_split(engine: Engine, m: dict[str, Any]) -> tuple[int, int]:
    host = nvme = 0
    for tier, key in ((engine.param_tier, "bytes_param_tier"), (engine.opt_tier, "bytes_optimizer_tier")):
        if tier.kind == "nvme":
            nvme += m[key]
        else:
            host += m[key]
    return host, nvme


@dataclasses.dataclass
class _Run:
    """The state of one run of the loop."""

    args: TrainArgs
    engine: Engine
    ckpt: Path
    data_pos: int
    job: Job
    saved: Path | None = None
    saved_step: int | None = None
    policy: policies.SaveDecisionPolicy | None = None  # when the loop saves (default: every args.save_every)
    agreed_stop: bool = False  # a multi-process job agreed to stop for a signal (StopAgreement.reached)
    losses: list[float] = dataclasses.field(default_factory=list)
    rates: list[float] = dataclasses.field(default_factory=list)
    nonfinite_in_a_row: int = 0

    def save(self) -> Path:
        """Checkpoints the current step, unless it is already saved (a skipped step changes nothing)."""
        if self.saved_step != self.engine.step:
            user = {"data_step": self.data_pos, "optimizer_step": self.engine.step}
            self.saved = self.engine.save(self.ckpt, user_state=user, max_to_keep=self.args.keep or None)
            self.saved_step = self.engine.step
            native_memory.trim()  # a save's buffers are freed now: hand their pages back (a long run stays flat)
        return self.saved


def _loop(run: _Run, log: TextIO, out: TextIO, stop: StopAgreement, seed: int) -> None:
    """Steps until ``args.steps`` optimizer steps are applied, a stop is requested or the loss stays non-finite."""
    args, engine, data = run.args, run.engine, corpus()
    run.policy = run.policy or policies.from_knobs(args.save_every)
    bar = Progress(args.steps, engine.step, out, args.progress, every=args.log_every)
    metrics = MetricsLog(log, args.tensorboard)
    tracing, steps_run = False, 0
    try:
        while engine.step < args.steps and not (run.agreed_stop if run.job.count > 1 else stop.requested):
            if args.profile and steps_run == PROFILE_STEPS.start:  # after the first step's compiles
                jax.profiler.start_trace(args.profile)
                tracing = True
            if tracing and steps_run == PROFILE_STEPS.stop:
                jax.profiler.stop_trace()
                tracing = False
            steps_run += 1
            m = engine.train_step(run.job.rows(batch_at(data, run.data_pos, args.batch, args.seq, seed)))
            m["tokens_per_s"] *= run.job.count  # each process counts its own rows: the job's rate
            run.data_pos += 1
            m["data_step"] = run.data_pos
            m["bytes_host"], m["bytes_nvme"] = _tier_split(engine, m)
            run.losses.append(m["loss"])
            run.rates.append(m["tokens_per_s"])
            metrics.write(engine.step, m)
            bar.update(engine.step, m)
            if not m["skipped"] and policies.should_save(run.policy, engine.step):
                run.save()
            if run.job.count > 1:  # one process's signal stops every process after the same step
                run.agreed_stop = stop.reached(run.data_pos)  # the data position grows every step
            run.nonfinite_in_a_row = 0 if math.isfinite(m["loss"]) else run.nonfinite_in_a_row + 1
            if run.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                break
    finally:
        if tracing:
            jax.profiler.stop_trace()
        bar.close()
        metrics.close()
    if args.profile and steps_run <= PROFILE_STEPS.start:
        out.write(f"warning: --profile {args.profile}: no trace written; the run stopped after {steps_run} step(s), "
                  f"before the traced steps {PROFILE_STEPS.start + 1}-{PROFILE_STEPS.stop}\n")
    notice = stop.take_notice()
    if notice:
        out.write(notice)


def _start(args: TrainArgs, config: ZeroConfig, ckpt: Path, out: TextIO, job: Job) -> _Run:
    if args.resume:
        engine, step_dir = _restore_newest_good(ckpt, args, config, out, job)
        run = _Run(args=args, engine=engine, ckpt=ckpt, data_pos=int(engine.user_state.get("data_step", engine.step)),
                   job=job)
        run.saved, run.saved_step = step_dir, engine.step
        return run
    ctor, kw = _engine_kwargs(args, config)
    return _Run(args=args, engine=initialize(ctor, **kw), ckpt=ckpt, data_pos=0, job=job)


def _summary(run: _Run, config: ZeroConfig, stop: StopAgreement, t0: float) -> dict[str, Any]:
    losses = run.losses
    return {
        "steps_run": len(losses), "step": run.engine.step, "data_step": run.data_pos,
        "interrupted": stop.requested, "signal": stop.name or None, "exit_code": stop.exit_code,
        "initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "median_tokens_per_s": float(np.median(run.rates)) if run.rates else None,
        "wall_s": time.perf_counter() - t0, "checkpoint": str(run.saved) if run.saved else None,
        "tiers": {"param": config.offload_param.device, "optimizer": config.offload_optimizer.device},
        "engine": run.engine.mode, "processes": run.job.count,
    }


def _report(summary: dict[str, Any], run_dir: Path, out: TextIO, job: Job) -> None:
    if job.primary:  # one summary per job
        with open(run_dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=1)
    head = f"interrupted by {summary['signal']}" if summary["interrupted"] else "done"
    out.write(
        f"{head}: {summary['steps_run']} steps (now at step {summary['step']}, data position {summary['data_step']}), "
        f"loss {summary['initial_loss']} -> {summary['final_loss']}, "
        f"{summary['median_tokens_per_s'] or 0:.0f} tok/s median ({summary['engine']} engine), "
        f"checkpoint {summary['checkpoint'] or 'none'}\n"
        f"metrics: {run_dir / 'metrics.jsonl'} (draw them: zinf-jax plot {run_dir})\n"
    )
    final = summary["final_loss"]
    if final is not None and not math.isfinite(final):
        raise NonFiniteLossError(
            f"the final loss is {final} (non-finite: the run diverged or its state is corrupt); stopped at step "
            f"{summary['step']}; newest checkpoint: {summary['checkpoint'] or 'none'}")


def _run_locked(args: TrainArgs, config: ZeroConfig, run_dir: Path, out: TextIO, stop: StopAgreement,
                job: Job) -> dict[str, Any]:
    """Everything that happens with the run dir locked: clean-up, build, loop, save, report.

    In a multi-process job, process 0 alone checks, clears and tidies the run dir (the others wait
    for it and stop too if it refuses), and writes the metrics and the summary.
    """
    ckpt = run_dir / "ckpt"
    own_tiers = [*_nvme_paths(args, config), str(run_dir / "nvme")]  # the default one too, whatever the tiers now

    def tidy() -> tuple[list[str], list[str]]:
        return (rundir.check_reuse(run_dir, own_tiers, resume=args.resume, overwrite=args.overwrite),
                rundir.remove_stale(ckpt))

    deleted, stale = job.on_primary(tidy, "the run dir checks") or ([], [])
    if deleted:
        out.write(f"zinf-jax train: --overwrite: deleted {', '.join(deleted)}\n")
    if stale:
        out.write(f"zinf-jax train: removed {len(stale)} unfinished save(s) of an earlier run: {', '.join(stale)}\n")
    _make_tier_dirs(args, config)
    stop.check("startup")
    t0 = time.perf_counter()
    run = None
    try:
        with engine_log(out):
            run = _start(args, config, ckpt, out, job)
        stop.check("startup (after building the engine)")
        with open(job.metrics_path(), "a") as log, engine_log(out):
            _loop(run, log, out, stop, config.seed)
        if stop.requested and not run.losses:
            stop.check("startup (before the first step)")
        if not run.losses or math.isfinite(run.losses[-1]):  # a diverged state is not saved over the good ones
            run.save()
    except BaseException:
        if run is not None:
            close_quietly(run.engine)  # releases the tier locks; the error raised here is the one to report
        # a new run that never trained: leave no tier state (one process: the others' may be in use)
        if not args.resume and not (run and run.losses) and job.count == 1:
            with contextlib.suppress(OSError, rundir.RunDirError):
                rundir.clear_tier_state(_nvme_paths(args, config))
        raise
    run.engine.close()
    summary = _summary(run, config, stop, t0)
    _report(summary, run_dir, out, job)
    return summary


def _fd_of(out: TextIO) -> int | None:
    """The file descriptor behind ``out`` if it is the process's stderr (for notices from a signal handler)."""
    if out not in (sys.stderr, sys.__stderr__):
        return None
    try:
        return out.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def train(args: TrainArgs, *, out: TextIO | None = None, stop: StopAgreement | None = None,
          given: frozenset[str] | None = None) -> dict[str, Any]:
    """Runs the main job; returns its summary (also printed and written as JSON).

    Args:
      args: the settings.
      out: where progress and messages go (default stderr).
      stop: the stop request to honour (default: one installed for the run when
        called from the main thread).
      given: the flags given explicitly (``TrainArgs`` field names; default: those differing from
        their defaults): with a config file, these override it.

    Returns:
      The summary; ``interrupted``/``signal``/``exit_code`` tell whether a
      signal stopped the run (after the step in progress, with a checkpoint).

    Raises:
      ValueError: a bad setting (``--flag VALUE: what is allowed``), or the run
        dir is in use or holds another run (:class:`~zinf_jax.app.rundir.RunDirError`).
      ConfigError, TierError, CheckpointError: bad input, with a clear message.
      Interrupted: a signal came before the first step (nothing saved).
      NonFiniteLossError: the final loss is not finite.
    """
    out = out or sys.stderr
    check_args(args)
    own = stop is None
    if own:
        stop = StopAgreement(fd=_fd_of(out))
    try:
        from zinf_jax.app.settings import resolve

        args, config, resolution = resolve(args, given)  # a config file may set the batch
        check_batch(args, config)
        if resolution is not None:
            out.write(f"zinf-jax train: {resolution}\n")
        stop.check("startup")
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        job = Job(run_dir)
        with rundir.RunLock(run_dir, job.lock_name), job.output(out) as mine:
            if job.count == 1:
                return _run_locked(args, config, run_dir, mine, stop, job)
            joined = current()  # zinf_jax.distributed: the peer watch, leaving in order
            if joined is None:
                raise DistributedError("a multi-process main job joins through zinf_jax.app.job.start "
                                       "(zinf.distributed.initialize), not jax.distributed.initialize alone")
            mine.write(f"zinf-jax train: process {job.index} of {job.count} (host {socket.gethostname()}); "
                       f"if one is lost the others stop within --peer-timeout {joined.peer_timeout} s\n")
            joined.watch.echo(None if mine is out else mine.write)
            with joined:  # a runtime failure first lets the watch tell whether a lost peer caused it
                return _run_locked(args, config, run_dir, mine, stop, job)
    finally:
        if own:
            stop.restore()

