"""`recpipe stats`: the table says which stats.json key holds each figure it prints (issue 32
item 7, the stats side: the table's `samples`, `S`, `bytes%`, ... are `rows`,
`samples_per_batch_session`, `100 * byte_share`, ... in the JSON)."""

from __future__ import annotations

from etl.stats_report import TABLE_KEYS
from tests.etl.test_stats_plots import make_report


def test_the_table_maps_each_label_to_a_json_key_that_exists(tmp_path):
    report = make_report(tmp_path)
    text, doc = report.format_table(), report.to_dict()
    (legend,) = [line for line in text.splitlines() if line.startswith("in stats.json: ")]
    body = text.replace(legend, "")
    feature = doc["features"][0]
    for label, keys, scale in TABLE_KEYS:
        assert f"{label} = {scale}{' / '.join(keys)}" in legend
        assert label in body, f"the table prints no {label!r}"
        for key in keys:
            _, sep, name = key.partition("features[].")
            assert (name in feature) if sep else (key in doc), key
    header = next(line for line in text.splitlines() if line.startswith("feature "))
    a = next(line for line in text.splitlines() if line.startswith("a "))
    cells = dict(zip(header.split(), a.split()))
    assert cells["bytes%"] == f"{100 * feature['byte_share']:.1f}"
    assert cells["measured"] == f"{feature['measured_factor']:.2f}x"
    assert f"samples  {doc['rows']:,} in" in text
