"""Kills one rank of a `recpipe train --nproc N --store hybrid` job in the middle of a
checkpoint (imported by a ``sitecustomize`` the test puts on the workers' PYTHONPATH).

``RECPIPE_STORE_KILL=POINT:RANK:STEP`` (read in torchrun's workers only, ``RANK`` set):

    commit   the rank's second store's commit of STEP: its rows are written to the uncommitted
             copies and synced, the commit record is not (its first store did commit STEP)
    header   after every store of the rank committed STEP, before the rank header and
             checkpoint.pt

``RECPIPE_STORE_KILL_MARK``: a file written just before the SIGKILL.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _die() -> None:
    Path(os.environ["RECPIPE_STORE_KILL_MARK"]).write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point: str, at: int) -> None:
    if point == "commit":
        from trainer.store.home import Home

        commit_to, seen = Home.commit_to, []

        def dying_commit(self, record):
            if record.step == at:
                seen.append(record)
                if len(seen) == 2:
                    _die()
            return commit_to(self, record)

        Home.commit_to = dying_commit
    elif point == "header":
        from trainer.distributed import checkpoint

        save_parts = checkpoint.save_parts

        def dying_save(root, *, step, **kwargs):
            if step == at:
                _die()
            return save_parts(root, step=step, **kwargs)

        checkpoint.save_parts = dying_save
    else:
        raise ValueError(point)


_spec = os.environ.get("RECPIPE_STORE_KILL")
if _spec and "RANK" in os.environ:
    _point, _rank, _at = _spec.split(":")
    if int(os.environ["RANK"]) == int(_rank):
        _install(_point, int(_at))
