"""`recpipe serve` and `recpipe train` expose the same reader options (one ReaderConfig), with
the same defaults: shuffle on."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from readers.source import COMMAND_READER_OPTIONS


def _options(command: str) -> dict[str, argparse.Action]:
    from recpipe_cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions if a.option_strings}


def test_train_and_serve_expose_the_same_reader_options():
    train, serve = _options("train"), _options("serve")
    for name in COMMAND_READER_OPTIONS:
        assert name in train, f"recpipe train has no option for {name!r}"
        assert name in serve, f"recpipe serve has no option for {name!r}"
        one, two = train[name], serve[name]
        assert one.option_strings == two.option_strings, name
        assert one.default == two.default, name
        assert one.choices == two.choices, name
    assert train["shuffle"].default is True
    assert "--no-shuffle" in serve["shuffle"].option_strings


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.common.data import synthetic_dataset

    root = tmp_path_factory.mktemp("serve_shuffle")
    return synthetic_dataset(root, requests=3000, seed=4, files=2, row_group_size=256)


def _served(monkeypatch, argv):
    """The producer ``recpipe serve ARGV`` would serve (the server is not started)."""
    import readers.service.server as server
    from recpipe_cli import main

    served = []
    monkeypatch.setattr(server, "serve", lambda producer, config: served.append(producer) or 0)
    assert main(["serve", *argv, "--warmup-batches", "0", "--quiet"]) == 0
    return served[0]


def _sessions(producer, epoch):
    from readers.service.producers import ShardSpec

    spec = ShardSpec(epoch=epoch)
    return np.concatenate([np.asarray(b.session_ids) for b in producer(spec)])


def test_serve_shuffles_by_default(dataset, monkeypatch):
    default = _served(monkeypatch, [str(dataset), "--batch-size", "128"])
    ordered = _served(monkeypatch, [str(dataset), "--batch-size", "128", "--no-shuffle"])
    assert default.shuffle and not ordered.shuffle
    plain = _sessions(ordered, 0)
    first, second = _sessions(default, 0), _sessions(default, 1)
    # the same rows, in another order, and another again the next epoch
    assert sorted(first.tolist()) == sorted(plain.tolist())
    assert not np.array_equal(first, plain)
    assert not np.array_equal(first, second)
