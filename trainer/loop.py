"""The one training loop of ``recpipe train``, for every mode: one process, ranks, towers.

::

    run_loop(config, engine, stream)
      resume: engine.restore(state), stream.load_state_dict(state["reader"]), the history
      per epoch:  for batch in stream:  engine.train_step(batch) -> logits (its loss pending)
                  every step: the history (samples, dedup factor, running AUC), progress
                  every --log-every steps: engine.pending_losses() (one reduction for many steps)
                  engine.after_step()                    (ranks: the hot set, once counted)
                  every --eval-every steps: engine.evaluate(stream.eval_batches())
                  every --checkpoint-every steps: engine.save(state)
      at the end: the last evaluation and checkpoint, engine.close(), the TrainResult

The loop owns epochs, evaluation, checkpoints, metrics, logging and progress; a
:class:`StepEngine` owns the model, its optimizers and where its rows live (TorchRec's
``TrainPipeline.progress()`` split the same way); a :class:`BatchStream` owns where batches come
from. Every mode gets every feature of the loop: a towers run checkpoints, resumes, evaluates
every ``--eval-every`` steps and writes metrics as a one-process run does.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from recpipe.errors import DataError, RecpipeError
from trainer.checkpoint import rng_state, set_rng_state
from trainer.metrics import peak_memory_bytes
from trainer.runlog import (
    EvalResult,
    RunLog,
    TrainResult,
    divergence_hint,
    format_bytes,
    run_targets,
)

if TYPE_CHECKING:
    from recpipe.batch import Batch
    from trainer.config import TrainConfig

__all__ = ["BatchStream", "StepEngine", "run_loop"]

_log = logging.getLogger(__name__)


class StepEngine(Protocol):
    """One mode's model, optimizers and step (one process, a rank, a towers rank).

    Attributes:
        step: optimizer steps taken (restored from a checkpoint).
        world_size: ranks in the job (1: one process); a step trains ``world_size`` batches.
        writer: this process writes the checkpoint's shared part, the metrics and the summary.
        device: where the model runs.
    """

    step: int
    world_size: int
    writer: bool
    device: torch.device

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step (collective across ranks); this process's logits. The step's
        loss is kept for :meth:`pending_losses`."""
        ...

    def pending_losses(self) -> list[float]:
        """The global mean losses of the steps since the last call, in order (collective)."""
        ...

    def after_step(self) -> float:
        """Work between steps (ranks: probe the links and choose the hot set once the accesses
        are counted); the seconds it took, which the loop leaves out of the training time."""
        ...

    def evaluate(self, batches: Iterable[Batch], *, max_batches: int | None) -> EvalResult:
        """Loss and AUC over the held-out ``batches`` (collective)."""
        ...

    def save(self, state: dict[str, Any]) -> Path:
        """Write a checkpoint at :attr:`step` holding ``state`` (the loop's: reader, history,
        RNG) besides the engine's own (collective); its path."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Take the engine's part of a checkpoint read at the start (collective)."""
        ...

    def close(self, *, failing: bool) -> None:
        """Release what the engine holds (stores, counters); ``failing``: the run is failing."""
        ...


class BatchStream(Protocol):
    """Where a run's batches come from (in process or a reader service), with its position.

    Attributes:
        epoch: the epoch the next batch belongs to.
        splits: row groups holding training rows, and held-out rows.
    """

    splits: tuple[int, int]

    @property
    def epoch(self) -> int: ...

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch (the next one once it is exhausted)."""
        ...

    def eval_batches(self) -> Iterable[Batch]:
        """The held-out batches, from the first."""
        ...

    def planned_steps(self, epochs: int) -> int | None:
        """Steps of ``epochs`` whole epochs, where known before reading (for the progress bar)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def run_loop(
    config: TrainConfig,
    engine: StepEngine,
    stream: BatchStream,
    *,
    resume_state: dict[str, Any] | None = None,
    progress: bool = True,
    desc: str = "train",
) -> TrainResult:
    """Train ``engine`` on ``stream`` as ``config`` says (collective across ranks).

    Args:
        config: the run (steps or epochs, evaluation, checkpoints, metrics, logging).
        engine: the mode's step engine.
        stream: its batches.
        resume_state: the checkpoint to continue (read by the caller before the engine was
            built: a hybrid store reopens at its step).
        progress: show a progress bar (the writer only).
        desc: the progress bar's label.
    """
    return _Loop(config, engine, stream, progress=progress and engine.writer, desc=desc).run(
        resume_state
    )


class _Loop:
    def __init__(
        self, config: TrainConfig, engine: StepEngine, stream: BatchStream, *, progress: bool,
        desc: str,
    ) -> None:  # fmt: skip
        self.config, self.engine, self.stream = config, engine, stream
        self.progress, self.desc = progress, desc
        self.log = RunLog(config, device=engine.device, write=engine.writer)
        self.unreduced: list[dict[str, Any]] = []  # metrics records waiting for their loss
        self.saved_step: int | None = None  # the step of the last checkpoint this run wrote
        self.bar: Any = None
        self.between_s = 0.0  # seconds of the engine's work between steps (not training)

    # -- checkpoints --------------------------------------------------------------------------
    def _restore(self, state: dict[str, Any]) -> None:
        self.engine.restore(state)
        self.stream.load_state_dict(state["reader"])
        if "rng" in state:
            set_rng_state(state["rng"])
        self.log.load_state_dict(state, step=self.engine.step)
        self.saved_step = self.engine.step
        _log.info("resumed from step %d (%s)", self.engine.step, self.config.checkpoint)

    def save(self) -> Path | None:
        """A checkpoint at this step (none without ``checkpoint``; not twice at one step)."""
        self._reduce_losses()
        if self.config.checkpoint is None:
            return None
        if self.saved_step == self.engine.step:
            from trainer.checkpoint import checkpoint_file

            return checkpoint_file(self.config.checkpoint)
        state = {"reader": self.stream.state_dict(), "rng": rng_state(), **self.log.state_dict()}
        path = self.engine.save(state)
        self.saved_step = self.engine.step
        _log.debug("checkpoint at step %d: %s", self.engine.step, path)
        return path

    # -- losses -------------------------------------------------------------------------------
    def _reduce_losses(self) -> None:
        """The pending steps' losses (one reduction for all of them), checked finite, and
        their metrics records."""
        losses = self.engine.pending_losses()
        for record, loss in zip(self.unreduced, losses, strict=True):
            if not math.isfinite(loss):
                msg = (
                    f"step {record['step']}: the training loss is {loss}; training stopped"
                    f"{divergence_hint(self.config, self.saved_step)}"
                )
                raise RecpipeError(msg)
        self.log.losses += losses
        for record, loss in zip(self.unreduced, losses, strict=True):
            self.log.record({**record, "loss": loss})
        self.unreduced = []

    # -- the loop -----------------------------------------------------------------------------
    def run(self, resume_state: dict[str, Any] | None) -> TrainResult:
        from recpipe.progress import progress_bar

        cfg, engine, log = self.config, self.engine, self.log
        if resume_state is not None:
            self._restore(resume_state)
        target_steps, target_epochs = run_targets(cfg)
        planned = target_steps
        if planned is None and target_epochs is not None:
            planned = self.stream.planned_steps(target_epochs)
        self.bar = bar = progress_bar(
            total=planned, initial=engine.step, unit="step", desc=self.desc, file=sys.stderr,
            disable=not self.progress, dynamic_ncols=True,
        )  # fmt: skip
        # one process reduces every step (its losses are at hand: a non-finite loss stops the
        # run at once); ranks every --log-every steps (one all-reduce for many steps)
        reduce_every = 1 if engine.world_size == 1 else cfg.log_every
        t0 = last = time.perf_counter()
        samples0 = log.samples
        done = self._finished(target_steps, target_epochs)
        empty_passes = 0
        try:
            log.open_sinks()
            while not done:
                empty_passes += 1
                for batch in self.stream:
                    empty_passes = 0
                    logits = engine.train_step(batch)
                    log.add_batch(batch, logits, samples=batch.batch_size * engine.world_size)
                    step = engine.step
                    bar.update(1)
                    now = time.perf_counter()
                    # evaluations and the engine's work between steps are not training time
                    train_s = now - t0 - log.eval_s - self.between_s
                    rate = (log.samples - samples0) / max(train_s, 1e-9)
                    memory = peak_memory_bytes(engine.device)
                    logged = step % cfg.log_every == 0 or step == target_steps
                    window_auc = log.window.auc() if logged else None
                    self.unreduced.append(log.train_record(
                        step=step, epoch=self.stream.epoch, auc=window_auc, samples_per_s=rate,
                        step_s=now - last, memory=memory, wall_s=train_s,
                    ))  # fmt: skip
                    last = now
                    if step % reduce_every == 0 or logged:
                        self._reduce_losses()
                    if logged:
                        bar.set_postfix(
                            loss=f"{np.mean(log.losses[-20:]):.4f}", auc=f"{window_auc:.3f}",
                            sps=f"{rate:,.0f}", mem=format_bytes(memory), refresh=False,
                        )  # fmt: skip
                    between = engine.after_step()
                    self.between_s += between
                    last += between  # the next step_s leaves it out
                    if cfg.eval_every and step % cfg.eval_every == 0:
                        last += self._evaluate(step)  # the next step_s leaves it out
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        self.save()
                    if target_steps is not None and step >= target_steps:
                        break
                done = self._finished(target_steps, target_epochs)
                if empty_passes >= 2 and not done:
                    rows = cfg.batch_size
                    per = (
                        f" per rank for {engine.world_size} ranks" if engine.world_size > 1 else ""
                    )
                    msg = f"{cfg.dataset}: the training split yields no batch of {rows} rows{per}"
                    raise DataError(msg)
            self._reduce_losses()
            wall = time.perf_counter() - t0 - log.eval_s - self.between_s  # train_wall_s
            if not log.evaluated_at(engine.step):
                self._evaluate(engine.step)
            path = self.save()
        except BaseException:
            self._close(failing=True)
            raise
        self._close(failing=False)
        return log.result(
            steps=engine.step, samples0=samples0, wall=wall, checkpoint=path,
            train_splits=self.stream.splits[0], eval_splits=self.stream.splits[1],
        )  # fmt: skip

    def _close(self, *, failing: bool) -> None:
        """Close the progress bar, the metrics and the engine; when the run is already failing,
        an error closing them is logged, not raised over the first one."""
        closers = [self.bar.close, self.log.close, lambda: self.engine.close(failing=failing)]
        for close in closers:
            try:
                close()
            except Exception:
                if not failing:
                    raise
                _log.debug("closing after the error above failed too", exc_info=True)

    def _finished(self, target_steps: int | None, target_epochs: int | None) -> bool:
        if target_steps is not None:
            return self.engine.step >= target_steps
        assert target_epochs is not None
        return self.stream.epoch >= target_epochs

    def _evaluate(self, step: int) -> float:
        """Evaluate on the held-out data; the seconds it took."""
        t0 = time.perf_counter()
        result = self.engine.evaluate(
            self.stream.eval_batches(), max_batches=self.config.eval_batches
        )
        seconds = time.perf_counter() - t0
        self.log.add_eval(step, result, epoch=self.stream.epoch, seconds=seconds)
        return seconds
