"""Dedup groups chosen at read time (``dedup_groups``): no rebuild, same results."""

from __future__ import annotations

import numpy as np
import pytest

from readers.dataset import make_dataloader
from readers.groups import read_groups_file, resolve_dedup_groups
from readers.source import ReaderConfig
from recpipe.errors import DataError, SchemaError
from tests.common.data import group_name


@pytest.fixture(scope="module")
def regrouped(tmp_path_factory):
    """One synthetic log set built twice: with no dedup group, and with the groups and partial
    features ``recpipe stats`` proposes for it at B=256."""
    from etl.build import BuildConfig, build
    from etl.stats import compute_stats
    from etl.synth import SynthConfig, generate
    from schemas import default_schema

    root = tmp_path_factory.mktemp("regroup")
    logs = generate(root / "raw", SynthConfig(num_requests=3000, seed=5, files=2))
    config = BuildConfig(row_group_size=512)
    bare = default_schema().with_dedup(())
    build(logs.features, root / "bare", events=logs.events, schema=bare, config=config)
    report = compute_stats(root / "bare", batch_size=256)
    proposed, partial = report.proposed_groups, report.proposed_partial
    assert proposed, "the synthetic data must propose some groups"
    assert partial == ["user_recent_items"]  # shifts on every request: partial, not a group
    schema = bare.with_dedup(proposed, partial)
    build(logs.features, root / "grouped", events=logs.events, schema=schema, config=config)
    return root / "bare", root / "grouped", tuple(tuple(g) for g in proposed)


def _toml_list(names) -> str:
    return repr([list(n) if isinstance(n, tuple) else n for n in names]).replace("'", '"')


def test_auto_groups_train_like_a_rebuild(regrouped, tmp_path):
    from trainer.models import ModelConfig
    from trainer.train import TrainConfig, train

    bare, grouped, _ = regrouped
    # the attention features named: `auto` resolves from each dataset's schema as written
    # (bare has no user group), as the groups read with never change the model
    small = ModelConfig(embedding_dim=8, num_embeddings=500, bottom_mlp=(8,), top_mlp=(8,),
                        attention=("user_liked_items", "user_liked_sellers"))  # fmt: skip
    common = {"batch_size": 256, "steps": 6, "eval_fraction": 0.1, "model": small}
    auto = train(TrainConfig(str(bare), dedup_groups="auto", **common), progress=False)
    rebuilt = train(TrainConfig(str(grouped), **common), progress=False)
    plain = train(TrainConfig(str(bare), **common), progress=False)
    assert auto.dedup_factor == pytest.approx(rebuilt.dedup_factor, rel=1e-12)
    assert auto.dedup_factor > 1.2 and plain.dedup_factor == 1.0
    np.testing.assert_allclose(auto.losses, rebuilt.losses, rtol=1e-6)


def test_loader_reads_any_groups_without_a_rebuild(regrouped, tmp_path):
    bare, grouped, proposed = regrouped
    config = ReaderConfig(batch_size=256)
    file = tmp_path / "groups.toml"
    file.write_text(f'[dedup]\ngroups = {_toml_list(proposed)}\npartial = ["user_recent_items"]\n')
    names = sorted([*map(group_name, proposed), "user_recent_items"])
    for spec in ("auto", file):
        loader = make_dataloader(bare, config=config, dedup_groups=spec)
        assert loader.dataset.schema.dedup_groups == proposed
        assert loader.dataset.schema.dedup_partial == ("user_recent_items",)
        reference = make_dataloader(grouped, config=config)
        for got, want in zip(loader, reference, strict=True):
            assert sorted(got.ikjts) == sorted(want.ikjts) == names
            for name in want.ikjts:
                assert got.ikjts[name].to_kjt().equals(want.ikjts[name].to_kjt())
            assert got.kjt.keys() == want.kjt.keys()
    listed = make_dataloader(bare, config=config, dedup_groups=proposed)  # groups, no partial
    assert listed.dataset.schema.dedup_groups == proposed
    assert listed.dataset.schema.dedup_partial == ()
    assert sorted(next(iter(listed)).ikjts) == sorted(map(group_name, proposed))
    none = make_dataloader(grouped, config=config, dedup_groups=[])
    assert next(iter(none)).ikjts == {}


def test_no_group_dedup_on_is_the_plain_path(regrouped, monkeypatch):
    """With no group, --dedup on reads exactly the batches of --dedup off and never enters the
    IKJT path (nothing to pay for)."""
    from recpipe.ikjt import InverseKeyedJaggedTensor

    bare, _, _ = regrouped

    def refuse(*args, **kwargs):
        raise AssertionError("the IKJT path ran without a dedup group")

    monkeypatch.setattr(InverseKeyedJaggedTensor, "from_arrow", refuse)
    config = ReaderConfig(batch_size=256)
    on = list(make_dataloader(bare, config=config, dedup=True))
    off = list(make_dataloader(bare, config=config, dedup=False))
    assert len(on) == len(off) > 1
    for a, b in zip(on, off, strict=True):
        assert a.ikjts == b.ikjts == {}
        assert a.kjt.keys() == b.kjt.keys()
        assert a.kjt.values().equal(b.kjt.values()) and a.kjt.lengths().equal(b.kjt.lengths())


def test_stats_reports_the_factor_of_the_groups_a_reader_gets(regrouped, tmp_path):
    """The stats' factor for a grouping (with partial features or not) equals the reader's ids
    / ids stored at that B."""
    from etl.stats import compute_stats

    bare, grouped, proposed = regrouped
    report = compute_stats(grouped, batch_size=256)
    partial = ["user_recent_items"]
    assert report.schema_groups == list(proposed) and report.schema_partial == partial
    merged = [("user_liked_items", "user_liked_sellers", "user_segment")]
    other = compute_stats(grouped, schema=report.schema.with_dedup(merged), batch_size=256)
    cases = (
        (report, list(proposed), partial),
        (report, list(proposed), []),
        (report, [], []),
        (report, [], ["user_recent_items", "user_liked_items"]),
        (other, merged, []),
    )
    for i, (stats, groups, part) in enumerate(cases):
        spec = tmp_path / f"dedup{i}.toml"
        spec.write_text(f"[dedup]\ngroups = {_toml_list(groups)}\npartial = {_toml_list(part)}\n")
        stored = expanded = 0
        config = ReaderConfig(batch_size=256)
        for batch in make_dataloader(bare, config=config, dedup_groups=spec):
            stored += batch.kjt.num_values + sum(g.num_values for g in batch.ikjts.values())
            expanded += batch.kjt.num_values + sum(
                g.num_expanded_values for g in batch.ikjts.values()
            )
        got = stats.groups_factor(groups, part)
        assert got == pytest.approx(expanded / stored, rel=1e-12), (groups, part)
    assert other.groups_factor(merged) != report.groups_factor(proposed)
    assert report.groups_factor(proposed, partial) > report.groups_factor(proposed)
    text = report.format_table()
    assert "schema's groups" in text and "proposed groups" in text and "upper bound" in text
    assert "+ partial [user_recent_items]" in text
    assert report.to_dict()["schema_groups_factor"] == report.groups_factor(proposed, partial)


def test_groups_errors(tmp_path):
    from schemas import default_schema

    schema = default_schema()
    bad = tmp_path / "bad.toml"
    bad.write_text("[dedup]\ngroupz = []\n")
    with pytest.raises(DataError, match="no \\[dedup\\] table with `groups`"):
        read_groups_file(bad)
    with pytest.raises(SchemaError, match="no_such_feature"):
        resolve_dedup_groups([["no_such_feature"]], schema=schema)
    with pytest.raises(DataError, match="needs the dataset directory"):
        resolve_dedup_groups("auto", schema=schema)
    with pytest.raises(DataError, match="cannot read it as TOML"):
        resolve_dedup_groups(tmp_path / "missing.toml", schema=schema)
    assert resolve_dedup_groups(None, schema=schema) is schema


def test_train_and_serve_take_dedup_groups(regrouped, monkeypatch):
    import readers.service.server
    import trainer.cli
    from recpipe_cli import main

    bare, _, proposed = regrouped
    built = []
    monkeypatch.setattr(trainer.cli, "run", lambda config, args: built.append(config) or 0)
    assert main(["train", str(bare), "--dedup-groups", "auto"]) == 0
    assert built[0].dedup_groups == "auto"
    served = []
    monkeypatch.setattr(readers.service.server, "serve", lambda p, config: served.append(p) or 0)
    argv = ["serve", str(bare), "--dedup-groups", "auto", "--batch-size", "256"]
    assert main(argv) == 0
    assert served[0].read_schema().dedup_groups == proposed  # resolved once, in the command
    assert served[0].dedup_groups == [list(g) for g in proposed]
