"""`recpipe synth --planted-groups`: features with a known group structure, for partitioners."""

from __future__ import annotations

import json

import pytest
import zstandard

from etl.synth import SynthConfig, generate, planted_groups
from recpipe.errors import RecpipeError
from schemas import load_schema


def _rows(paths):
    out = []
    for path in paths:
        text = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
        for line in text.decode().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the generator's deliberately bad lines
    return out


def test_planted_features_follow_their_group_and_the_schema_lists_them(tmp_path):
    cfg = SynthConfig(num_requests=400, seed=3, planted_groups=2, planted_features=3,
                      planted_noise=0.0, bad_fraction=0.0)  # fmt: skip
    logs = generate(tmp_path / "a", cfg)
    groups = planted_groups(cfg)
    assert logs.summary["planted"]["groups"] == [list(g) for g in groups]
    schema = load_schema(tmp_path / "a" / "_schema.toml")
    assert [n for n in schema.sparse_names if n.startswith("planted_")] == [
        f for g in groups for f in g
    ]
    rows = [r["sparse"] for r in _rows(logs.features) if "planted_0_0" in r.get("sparse", {})]
    assert len(rows) >= 300
    for group in groups:
        # without noise a group's features show one latent value: each id fixes the others
        seen: dict[int, tuple[int, ...]] = {}
        for row in rows:
            ids = tuple(row[f][0] for f in group)
            assert seen.setdefault(ids[0], ids) == ids
        assert len(seen) > 1
    again = generate(tmp_path / "b", cfg)
    assert [p.read_bytes() for p in again.features] == [p.read_bytes() for p in logs.features]


def test_planted_groups_are_off_by_default_and_checked(tmp_path):
    logs = generate(tmp_path / "plain", SynthConfig(num_requests=50, seed=3))
    assert "planted" not in logs.summary
    assert not (tmp_path / "plain" / "_schema.toml").exists()
    with pytest.raises(RecpipeError, match="`planted_noise` must be in"):
        SynthConfig(planted_noise=1.5)
