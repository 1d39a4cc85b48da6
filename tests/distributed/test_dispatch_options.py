"""``recpipe train --dispatch/--alpha``: parsed into the multi-rank options and checked."""

from __future__ import annotations

import pytest

from recpipe.errors import RecpipeError
from recpipe_cli import build_parser
from trainer.distributed.config import DistributedConfig
from trainer.distributed.launch import distributed_config


def _parse(*options: str):
    return build_parser("train").parse_args(["train", "data", "--nproc", "2", *options])


def test_dispatch_and_alpha_reach_the_distributed_config():
    assert (distributed_config(_parse()).dispatch, distributed_config(_parse()).alpha) == (
        "contiguous",
        1.0,
    )
    options = distributed_config(
        _parse("--dispatch", "esd", "--alpha", "0.25", "--cache-rows", "64")
    )
    assert (options.dispatch, options.alpha) == ("esd", 0.25)
    assert distributed_config(_parse("--dispatch", "round-robin")).dispatch == "round-robin"


@pytest.mark.parametrize(
    "options", [("--dispatch", "nearest"), ("--alpha", "1.5"), ("--alpha", "x")]
)
def test_bad_values_are_usage_errors(options, capsys):
    with pytest.raises(SystemExit) as exc:
        distributed_config(_parse(*options))
    assert exc.value.code == 2
    assert options[0] in capsys.readouterr().err


def test_the_config_checks_itself():
    with pytest.raises(RecpipeError, match="`alpha` must be in"):
        DistributedConfig(alpha=-0.1)
    with pytest.raises(RecpipeError, match="`dispatch` must be one of"):
        DistributedConfig(dispatch="nearest")


def test_cache_rows_and_bandwidths_reach_the_distributed_config():
    assert (distributed_config(_parse()).cache_rows, distributed_config(_parse()).bandwidths) == (
        0,
        (1e9,),
    )
    options = distributed_config(
        _parse("--dispatch", "esd", "--cache-rows", "4096", "--bandwidths", "1e9,1e10")
    )
    assert (options.cache_rows, options.bandwidths) == (4096, (1e9, 1e10))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cache_rows": -1}, "`cache_rows` must be a non-negative integer"),
        ({"cache_rows": 8, "hot_rows": 16}, "a job with caches has no hot set"),
        ({"bandwidths": (1e9, 0.0)}, "`bandwidths` must be positive"),
    ],
)
def test_the_cache_options_check_themselves(kwargs, message):
    with pytest.raises(RecpipeError, match=message):
        DistributedConfig(**kwargs)


def test_exact_dense_is_the_default_and_fast_dense_turns_it_off():
    assert distributed_config(_parse()).exact_dense is True
    assert distributed_config(_parse("--fast-dense")).exact_dense is False
    assert distributed_config(_parse("--exact-dense")).exact_dense is True  # the old flag: a no-op
