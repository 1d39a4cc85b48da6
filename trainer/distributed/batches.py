"""Global batches: the ranks' micro-batches of one step, put together in one process.

A W-rank job's step ``t`` trains on rank 0's ``t``-th batch, rank 1's, ... together. One process
trains on the same global batch by concatenating them in rank order (:func:`concat_batches`);
that is the reference every multi-rank result is checked against, and what a single process
does when it resumes a multi-rank job's data layout (:func:`global_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from recpipe.batch import Batch
from recpipe.errors import DataError
from recpipe.ikjt import InverseKeyedJaggedTensor, PartialInverseKeyedJaggedTensor
from recpipe.jagged import JaggedTensor, KeyedJaggedTensor

__all__ = ["concat_batches", "global_batches"]


def _concat_kjt(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    keys = kjts[0].keys()
    if any(k.keys() != keys for k in kjts):
        msg = f"the batches' plain features differ: {[k.keys() for k in kjts]!r}"
        raise DataError(msg)
    if not keys:
        return KeyedJaggedTensor.from_jagged_dict({}, stride=sum(k.stride() for k in kjts))
    parts = [k.to_dict() for k in kjts]
    return KeyedJaggedTensor.from_jagged_dict(
        {
            key: JaggedTensor.from_lengths(
                torch.cat([p[key].values() for p in parts]),
                torch.cat([p[key].lengths() for p in parts]),
                validate=False,
            )
            for key in keys
        }
    )


def _concat_group(groups: Sequence[InverseKeyedJaggedTensor]) -> InverseKeyedJaggedTensor:
    """The unique rows one after the other; each inverse lookup shifted past the rows before."""
    unique = _concat_kjt([g.unique for g in groups])
    shifts, inverses = 0, []
    for g in groups:
        inverses.append(g.inverse_lookup + shifts)
        shifts += g.num_unique
    return InverseKeyedJaggedTensor.from_unique(unique, torch.cat(inverses), validate=False)


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One batch of the rows of ``batches``, in order (the same features in each).

    A dedup group stays an IKJT whose unique rows are the parts' unique rows side by side (rows
    equal across parts are not merged: the model computes the same either way); a partial IKJT
    group is expanded into the plain features.
    """
    if not batches:
        msg = "`batches` is empty"
        raise DataError(msg)
    if len(batches) == 1:
        return batches[0]
    names = list(batches[0].ikjts)
    if any(list(b.ikjts) != names for b in batches):
        msg = f"the batches' dedup groups differ: {[list(b.ikjts) for b in batches]!r}"
        raise DataError(msg)
    plain = [b.kjt for b in batches]
    ikjts = {}
    for name in names:
        groups = [b.ikjts[name] for b in batches]
        if any(isinstance(g, PartialInverseKeyedJaggedTensor) for g in groups):
            plain = [KeyedJaggedTensor.concat([p, g.to_kjt()]) for p, g in zip(plain, groups)]
        else:
            ikjts[name] = _concat_group(groups)
    sessions = [b.session_ids for b in batches]
    return Batch(
        dense=torch.cat([b.dense for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
        kjt=_concat_kjt(plain),
        ikjts=ikjts,
        session_ids=None if any(s is None for s in sessions) else torch.cat(sessions),
    )


def global_batches(streams: Sequence[Iterator[Batch]]) -> Iterator[Batch]:
    """Concatenate the ``t``-th batch of every rank's stream, step by step, while all have one."""
    iterators = [iter(s) for s in streams]
    while True:
        parts = []
        for it in iterators:
            batch = next(it, None)
            if batch is None:
                return
            parts.append(batch)
        yield concat_batches(parts)
