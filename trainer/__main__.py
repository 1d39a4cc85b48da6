"""``torchrun --nproc-per-node N -m trainer DATASET ...``: one worker of a multi-rank
``recpipe train`` (the same options; see :mod:`trainer.distributed.launch`)."""

from __future__ import annotations

import sys

from trainer.distributed.launch import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
