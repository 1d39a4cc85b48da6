"""``recpipe synth``: its options (generated from :class:`etl.synth.SynthConfig`) and summary."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from etl.synth import SynthConfig, SynthResult, generate
from recpipe.config_cli import ConfigOptions, Option, add_config_options, add_quiet_option

__all__ = ["format_summary", "register_cli"]

_PLANTED = ("planted_groups", "planted_features", "planted_noise", "planted_strength")


def _planted_row(planted: dict[str, Any]) -> list[tuple[str, str]]:
    groups = planted["groups"]
    shape = f"{len(groups)} x {len(groups[0])} features (schema: {planted['schema']})"
    return [("planted groups", shape)]


def format_summary(result: SynthResult) -> str:
    s = result.summary
    sps = s["samples_per_session"]
    bad = sum(result.num_bad.values())
    rows = [
        ("output", str(result.root)),
        ("requests", f"{s['num_requests']:,} ({bad:,} bad)"),
        ("events", f"{s['num_events']:,} ({sum(result.num_bad_events.values()):,} bad)"),
        ("sessions", f"{s['num_sessions']:,}"),
        (
            "samples/session",
            f"mean {sps['mean']:.2f}  p50 {sps['p50']:.0f}  p90 {sps['p90']:.0f}  "
            f"p99 {sps['p99']:.0f}  max {sps['max']}",
        ),
        (
            "samples/session per 4096 batch",
            f"{s['samples_per_session_in_time_batch_4096'] or 0:.3f}",
        ),
        ("label rate", f"{s['label_rate']:.4f}"),
        ("hidden-model AUC", f"{s['hidden_model_auc']:.4f}"),
        *(_planted_row(s["planted"]) if "planted" in s else []),
        ("bytes written", f"{s['bytes'] / 1e6:.1f} MB"),
        ("time", f"{s['elapsed_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _run(args: argparse.Namespace, options: tuple[ConfigOptions, ConfigOptions]) -> int:
    from etl.paths import check_output

    check_output(args.out, kind="synth")
    main, planted = options
    cfg = main.build(args, **planted.values(args))
    result = generate(args.out, cfg, progress=not args.quiet)
    print(format_summary(result))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recpipe synth``."""
    parser = subparsers.add_parser(
        "synth",
        help="generate deterministic synthetic session logs",
        description=(
            "Write synthetic feature and event logs (.jsonl.zst, the raw-log format of "
            "docs/data-contract.md) following "
            "schemas/examples/synth.toml: interleaved sessions with a long-tailed length, static "
            "and slowly shifting user features, labels from a hidden model. The same seed gives "
            "byte-identical files. --out must be new, empty, or an earlier synth output (it has "
            "_synth.json), which is rewritten."
        ),
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    main = add_config_options(
        parser,
        SynthConfig,
        exclude=_PLANTED,
        overrides={
            "num_requests": Option(flag="--requests", metavar="N"),
            "with_session_id": Option(flag="--session-id"),
        },
    )
    group = parser.add_argument_group(
        "planted interactions",
        "groups of one-id features with a known interaction structure, for feature "
        "partitioners (off by default); the schema with them is written to OUT/_schema.toml",
    )
    planted = add_config_options(
        group,
        SynthConfig,
        include=_PLANTED,
        overrides={
            "planted_groups": Option(metavar="G"),
            "planted_features": Option(metavar="M"),
            "planted_noise": Option(metavar="P"),
            "planted_strength": Option(metavar="W"),
        },
        owner=parser,
    )
    add_quiet_option(parser)
    parser.set_defaults(func=lambda args: _run(args, (main, planted)))
