"""The `recpipe` command line: every subcommand is listed, and ETL never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recpipe_cli import SUBCOMMANDS, build_parser, main

COMMANDS = ["synth", "etl", "stats", "fit", "serve", "train", "store", "towers"]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command} " in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_subcommand_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"usage: recpipe {command}" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: recpipe" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["etl", "build", "--help"], ["stats", "--help"], ["synth", "--help"]]
)
def test_etl_commands_do_not_import_torch(argv):
    code = (
        "import sys\n"
        "from recpipe_cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "recpipe_cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "usage: recpipe" in out.stdout


# `recpipe train`'s options before they were generated from TrainConfig and ModelConfig.
TRAIN_OPTIONS_BEFORE = {
    "--dedup": "on", "--steps": None, "--epochs": None, "--batch-size": 4096, "--lr": None,
    "--optimizer": "adagrad", "--eval-fraction": 0.1, "--eval-every": 0, "--eval-batches": None,
    "--device": "cpu", "--checkpoint": None, "--checkpoint-every": 0, "--resume": False,
    "--service": None, "--store": "module", "--seed": 0, "--workers": 0, "--preprocess": None,
    "--embedding-dim": 16, "--num-embeddings": 100_000, "--attention": "auto", "--json": None,
    "--no-progress": False,
}  # fmt: skip


def test_train_keeps_every_option_and_default(monkeypatch):
    import trainer.cli
    from trainer.config import TrainConfig

    parser = build_parser("train")
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    by_flag = {f: a for a in train_parser._actions for f in a.option_strings}
    for flag, default in TRAIN_OPTIONS_BEFORE.items():
        assert flag in by_flag, flag
        assert by_flag[flag].default == {"on": True}.get(default, default), flag
    built = []
    monkeypatch.setattr(trainer.cli, "run", lambda config, args: built.append(config) or 0)
    assert main(["train", "DS"]) == 0
    assert built == [TrainConfig(dataset="DS")]  # the options' defaults are the config's


def _options(*path: str) -> dict[str, object]:
    """Option string -> its action, of the subcommand ``path``."""
    parser = build_parser(path[0])
    for name in path:
        parser = next(a for a in parser._actions if a.choices and name in a.choices).choices[name]
    return {flag: action for action in parser._actions for flag in action.option_strings}


# `recpipe etl build`'s options before they were generated from BuildConfig, with their defaults.
BUILD_OPTIONS_BEFORE = {
    "--events": None, "--out": None, "--schema": None, "--memory-limit": None,
    "--spill-dir": None, "--threads": None, "--session-gap": 1_800_000, "--sample-sessions": 1.0,
    "--seed": 0, "--zstd-level": 3, "--row-group-size": 65_536, "--min-row-groups": 8,
    "--order": "session", "--engine": "duckdb", "--master": None, "--spark-partitions": None,
    "--partition-by": "none", "--max-line-bytes": 64 << 20, "--fail-missing-share": 1.0,
    "--allow-missing-features": False, "--overwrite": False, "--no-progress": False,
    "--json": False,
}  # fmt: skip


def test_etl_build_keeps_every_option_and_default(monkeypatch):
    import etl.build.cli
    from etl.build.config import BuildConfig

    by_flag = _options("etl", "build")
    for flag, default in BUILD_OPTIONS_BEFORE.items():
        assert flag in by_flag, flag
        assert by_flag[flag].default == default, flag
    built = []
    run = lambda args, config: built.append((config, args.quiet)) or 0  # noqa: E731
    monkeypatch.setattr(etl.build.cli, "_run_cli", run)
    assert main(["etl", "build", "IN", "--out", "O"]) == 0
    assert main(["etl", "build", "IN", "--out", "O", "--session-gap", "2h", "--seed", "3",
                 "--max-line-bytes", "1KB", "--spill-dir", "S", "--sample-sessions", "0.5",
                 "--order", "time", "--engine", "spark", "--master", "local[2]",
                 "--spark-partitions", "4", "--partition-by", "hour", "--no-progress",
                 "--allow-missing-features", "--fail-missing-share", "0.5"]) == 0  # fmt: skip
    assert built == [
        (BuildConfig(), False),
        (BuildConfig(session_gap_ms=7_200_000, seed=3, max_line_bytes=1000, spill_dir=Path("S"),
                     sample_sessions=0.5, order="time", engine="spark", master="local[2]",
                     spark_partitions=4, partition_by="hour", allow_missing_features=True,
                     fail_missing_share=0.5), True),
    ]  # fmt: skip


def test_etl_build_refuses_a_bad_value_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["etl", "build", "IN", "--out", "O", "--master", "local[2]"])
    assert exc.value.code == 2
    assert "`--master` is an option of engine 'spark'" in capsys.readouterr().err


# `recpipe serve`'s options before the server's were generated from ServiceConfig.
# (--shuffle is on by default, as `recpipe train` shuffles; --no-shuffle turns it off)
SERVE_OPTIONS_BEFORE = {
    "--host": "127.0.0.1", "--port": 0, "--token": None, "--token-file": None,
    "--insecure": False, "--max-clients": 64, "--max-readers": None, "--max-pending": 32,
    "--handshake-timeout": 10.0, "--readers": 2, "--idle-readers": None,
    "--warmup-batches": 20, "--read-ahead": 1, "--batch-size": 4096, "--queue-depth": 8,
    "--dedup": "on", "--dedup-groups": None, "--extras": "", "--preprocess": None,
    "--schema": None, "--shuffle": True, "--seed": 0, "--dispatch": "contiguous",
    "--alpha": 1.0, "--report-every": 10.0, "--synthetic": None,
}  # fmt: skip


def test_serve_keeps_every_option_and_default(monkeypatch):
    import readers.service.server
    from readers.service.config import ServiceConfig

    by_flag = _options("serve")
    for flag, default in SERVE_OPTIONS_BEFORE.items():
        assert flag in by_flag, flag
        assert by_flag[flag].default == default, flag
    monkeypatch.delenv("RECPIPE_TOKEN", raising=False)
    served = []
    monkeypatch.setattr(readers.service.server, "serve", lambda p, config: served.append(config))
    assert main(["serve", "--synthetic", "1"]) == 0
    assert main(["serve", "--synthetic", "1", "--host", "0.0.0.0", "--port", "9", "--readers",
                 "3", "--idle-readers", "1", "--queue-depth", "4", "--max-clients", "5",
                 "--max-readers", "6", "--max-pending", "7", "--handshake-timeout", "2.5",
                 "--report-every", "0", "--insecure", "--token", "t"]) == 0  # fmt: skip
    assert served == [
        ServiceConfig(),
        ServiceConfig(host="0.0.0.0", port=9, readers=3, idle_readers=1, queue_depth=4,
                      max_clients=5, max_readers=6, max_pending=7, handshake_timeout_s=2.5,
                      report_every_s=0.0, insecure=True, token="t"),
    ]  # fmt: skip


# `recpipe etl shard`'s options before they were generated from ShardConfig.
SHARD_OPTIONS_BEFORE = ["--out", "--num-shards", "--by", "--zstd-level", "--schema", "--buffer-mb",
                        "--no-group", "--no-compare", "--max-line-bytes", "--overwrite", "--json",
                        "--quiet"]  # fmt: skip


def test_etl_shard_keeps_every_option_and_default(monkeypatch):
    import etl.shard

    assert set(SHARD_OPTIONS_BEFORE) <= set(_options("etl", "shard"))
    built = []
    run = lambda args, config: built.append((config, args.quiet)) or 0  # noqa: E731
    monkeypatch.setattr(etl.shard, "_run_cli", run)
    assert main(["etl", "shard", "IN", "--out", "O"]) == 0
    assert main(["etl", "shard", "IN", "--out", "O", "--num-shards", "3", "--by", "request",
                 "--zstd-level", "5", "--buffer-mb", "2", "--no-group", "--no-compare",
                 "--max-line-bytes", "100", "--quiet"]) == 0  # fmt: skip
    assert built == [
        (etl.shard.ShardConfig(), False),
        (etl.shard.ShardConfig(num_shards=3, by="request", zstd_level=5, buffer_mb=2,
                               group=False, compare=False, max_line_bytes=100), True),
    ]  # fmt: skip


def _failing_synth(monkeypatch, exc: BaseException) -> None:
    import etl.synth_cli

    def run(args, options):
        raise exc

    monkeypatch.setattr(etl.synth_cli, "_run", run)


# What torch's CPU allocator raises (a RuntimeError) when an allocation fails.
TORCH_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 16000000000000000 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (PermissionError(13, "Permission denied", "/x/y"), "Permission denied: '/x/y'"),
        (OSError(18, "Invalid cross-device link", "/a", None, "/b"),
         "Invalid cross-device link: '/a' -> '/b'"),
        (OSError(28, "No space left on device"), "No space left on device, writing `--out` 'O'"),
        (OSError(24, "Too many open files"), "Too many open files"),
        (MemoryError("Unable to allocate 8.00 EiB"), "out of memory (Unable to allocate 8.00 EiB)"),
        (RuntimeError(f"{TORCH_OOM}\nframe #0: ..."), f"out of memory ({TORCH_OOM})"),
    ],
)  # fmt: skip
def test_an_os_or_memory_error_is_one_line(monkeypatch, capsys, exc, line):
    _failing_synth(monkeypatch, exc)
    assert main(["synth", "--out", "O"]) == 1
    assert capsys.readouterr().err == f"recpipe synth: error: {line}\n"


def test_verbose_shows_the_traceback_above_the_line(monkeypatch, capsys):
    _failing_synth(monkeypatch, OSError(28, "No space left on device"))
    assert main(["--verbose", "synth", "--out", "O"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("recpipe synth: error: No space left on device, writing `--out` 'O'\n")


@pytest.mark.parametrize("exc", [ValueError("a bug"), RuntimeError("a bug")])
def test_other_exceptions_keep_their_traceback(monkeypatch, exc):
    _failing_synth(monkeypatch, exc)
    with pytest.raises(type(exc), match="a bug"):
        main(["synth", "--out", "O"])


def test_a_stdout_that_cannot_be_written_is_named(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    line = '{"request_id": "r", "session_id": "s", "user_id": 1, "ts": 1700000000000}\n'
    (tmp_path / "f.jsonl").write_text(line * 3)
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "recpipe_cli", "etl", "validate", str(tmp_path), "--json"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == "recpipe etl: error: No space left on device: '<stdout>'\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["synth", "--out", "O", "--requests", str(10**30)],
         f"argument --requests: '{10**30}' does not fit in a 64-bit integer"),
        (["synth", "--out", "O", "--bad-fraction", "nan"],
         "argument --bad-fraction: must be a number, got 'nan'"),
        (["towers", "partition", "DS", "--towers", "0"], "`--towers` must be a positive integer"),
        (["etl", "validate", "IN", "--sample", "0"],
         "argument --sample: must be a positive integer, got '0'"),
    ],
)  # fmt: skip
def test_a_nonsense_value_is_a_usage_error_naming_the_flag(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / a) if a in ("O", "DS", "IN") else a for a in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_refusal_names_the_flag_the_user_gave(monkeypatch, capsys):
    from recpipe.errors import RecpipeError

    _failing_synth(monkeypatch, RecpipeError("`seed` must be small, got 3; see `seed` in X"))
    assert main(["synth", "--out", "O", "--seed", "3"]) == 1
    assert capsys.readouterr().err.endswith(
        "error: `--seed` must be small, got 3; see `seed` in X\n"
    )
    assert main(["synth", "--out", "O"]) == 1  # not given: the message is the library's own
    assert capsys.readouterr().err.endswith("error: `seed` must be small, got 3; see `seed` in X\n")


def test_top_level_help_imports_no_command_module():
    """`recpipe --help` and a bare `recpipe` list the commands from their names and summaries:
    no subcommand module, so neither torch nor numba, is imported (it took 2 s of CPU)."""
    code = (
        "import sys, recpipe_cli\n"
        "for argv in (['--help'], []):\n"
        "    try:\n"
        "        recpipe_cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('torch', 'numba', 'trainer', 'readers', 'etl') if m in sys.modules]\n"
        "sys.exit(f'imported {heavy}' if heavy else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = " ".join(done.stdout.split())
    for name, _, summary in SUBCOMMANDS:
        assert f"{name} {summary.split()[0]}" in listed, name
