"""`recpipe train --threads`: its default is the cores free for the process."""

from __future__ import annotations

import os

import pytest

from trainer.config import TrainConfig, default_threads

CORES = len(os.sched_getaffinity(0))


def test_an_idle_machine_gives_every_core_of_the_process():
    assert default_threads({}, load=0.0) == CORES


def test_ranks_of_a_node_share_its_cores():
    assert default_threads({"LOCAL_WORLD_SIZE": str(CORES)}, load=0.0) == 1
    assert default_threads({"LOCAL_WORLD_SIZE": "2"}, load=0.0) == max(1, CORES // 2)


def test_a_busy_machine_gives_one_thread():
    assert default_threads({}, load=float(os.cpu_count() or 1)) == 1
    assert default_threads({}, load=1e9) == 1


def test_threads_must_be_positive():
    with pytest.raises(Exception, match="`threads` must be a positive integer, got 0"):
        TrainConfig("ds", threads=0)
