"""Shared fixtures, built up in scopes: generated logs -> clustered dataset -> (function) readers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault(
    "NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache")
)


@pytest.fixture(scope="session")
def synth_logs(tmp_path_factory):
    """20k synthetic requests with 2% bad records of every kind."""
    from etl.synth import SynthConfig, generate

    return generate(
        tmp_path_factory.mktemp("synth_bad"),
        SynthConfig(num_requests=20_000, seed=7, bad_fraction=0.02),
    )


@pytest.fixture(scope="session")
def clean_synth_logs(tmp_path_factory):
    """20k synthetic requests, no bad records."""
    from etl.synth import SynthConfig, generate

    return generate(
        tmp_path_factory.mktemp("synth_clean"), SynthConfig(num_requests=20_000, seed=7)
    )


@pytest.fixture(scope="session")
def clustered_dataset(tmp_path_factory, clean_synth_logs):
    """The clustered dataset built from `clean_synth_logs` with the bundled schema."""
    from etl.build import BuildConfig, build
    from schemas import default_schema

    out = tmp_path_factory.mktemp("dataset") / "clustered"
    build(
        clean_synth_logs.features,
        out,
        events=clean_synth_logs.events,
        schema=default_schema(),
        config=BuildConfig(),
    )
    return out
