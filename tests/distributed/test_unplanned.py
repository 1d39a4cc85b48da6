"""A sharded table reads a batch only through its id plan: the model run on a batch without
the plan that prepare() gave it is refused in one line (no search among the prepared ids)."""

from __future__ import annotations

import pytest
import torch

from recpipe.errors import RecpipeError
from tests.distributed.test_idplan import _batches, _trainer


def test_a_batch_without_its_plan_is_refused(dist_dataset):
    trainer = _trainer(dist_dataset)
    trainer.module.eval()
    batch = _batches(dist_dataset, count=1)[0]
    with torch.no_grad():
        planned = trainer.sparse.prepare(batch, train=False)
        trainer.module(planned)  # the rows prepared, read at the plan's positions
        with pytest.raises(RecpipeError, match=r"the batch carries no id plan; run the model on"):
            trainer.module(planned.unplanned())
