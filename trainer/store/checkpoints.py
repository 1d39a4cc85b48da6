"""Checkpointing several stores at once (one per table: a rank's, or one process's).

:func:`checkpoint_stores` commits every store at a step together: each store freezes its changed
rows at the step boundary (no copy) and starts its checkpoint in its own writer thread
(:mod:`trainer.store.writer`), and only then is each waited for, so the stores' writes and
fsyncs overlap (one wave of them, not one store after another). It uses the stores' public
methods only (:meth:`~trainer.store.EmbeddingStore.checkpoint`,
:meth:`~trainer.store.EmbeddingStore.wait_checkpoint`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from recpipe.errors import RecpipeError

if TYPE_CHECKING:
    from trainer.store.store import EmbeddingStore

__all__ = ["checkpoint_stores"]


def checkpoint_stores(stores: Sequence[EmbeddingStore], step: int) -> list[dict[str, Any]]:
    """Make every store's state after ``step`` durable, the stores' writers all at once.

    Each store freezes its changed rows (no copy) and starts its checkpoint in its own writer
    thread; once all have started, each is waited for. Nothing trains meanwhile, so the rows
    written are those of ``step``, as with one blocking checkpoint after another.

    Returns:
        each store's checkpoint summary, in the order of ``stores``.

    Raises:
        RecpipeError: a store's files could not be written (naming the first such store; the
            previous checkpoint is kept), after every started writer has stopped.
    """
    futures: list[Future[dict[str, Any]]] = []
    failed: dict[int, tuple[EmbeddingStore, OSError]] = {}

    def wait(k: int) -> None:
        try:
            stores[k].wait_checkpoint()  # the writer's checkpoint in flight (errors re-raised)
        except OSError as exc:
            failed[k] = (stores[k], exc)

    with contextlib.ExitStack() as waits:  # every started writer stops before this goes on
        for k, store in enumerate(stores):
            try:
                futures.append(store.checkpoint(step, wait=False))
            except OSError as exc:
                failed[k] = (store, exc)
                break
            waits.callback(wait, k)
    if failed:
        store, exc = failed[min(failed)]
        msg = (
            f"{store.root}: cannot write the embedding store's checkpoint of step {step}: "
            f"{exc.strerror or exc}; the previous checkpoint is kept"
        )
        raise RecpipeError(msg) from None
    return [future.result() for future in futures]
