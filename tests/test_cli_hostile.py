"""Every command against an output it cannot write, and nonsense option values, through the CLI.

Each case runs ``python -m recpipe_cli --quiet ...`` in a subprocess (its own session, killed
whole after a hard timeout) and asserts what a user must see when a command cannot do its work:
a non-zero exit status (not a signal, not a hang), one error line on stderr (``recpipe
<command>: error: ...``; after argparse's usage block for a usage error; ``hint:`` lines
allowed) naming the path or the flag, and no Python traceback.

The outputs (``KINDS``):

* ``unwritable``: a directory of mode 0555 (``EACCES``). Root ignores mode bits, so as root the
  command runs under ``setpriv`` without ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` (still
  uid 0, reading what root owns);
* ``readonly``: a read-only tmpfs (``EROFS``);
* ``full``: a small tmpfs filled to its last byte (``ENOSPC``); a command that writes only to
  stdout gets ``/dev/full`` there.

``serve`` writes nothing but its log, so it gets only the nonsense values. Mounting a tmpfs
needs root; elsewhere those cases are skipped with the reason. The cases that load torch or
start reader processes before they end are marked slow (most refusals come from the option
parser and take a fraction of a second).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from recpipe_cli import build_parser
from schemas import default_schema
from tests.common.data import synthetic_dataset

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # seconds: every case must end well before (an accepted value may hang `serve`)
KINDS = ("unwritable", "readonly", "full")
MODEL = ["--embedding-dim", "4", "--num-embeddings", "200", "--bottom-mlp", "8", "--top-mlp", "8"]
TRAIN = ["--steps", "1", "--batch-size", "32", "--eval-batches", "1", *MODEL]
PARTITION = ["towers", "partition", "{ds}", "--towers", "2", "--steps", "1", "--batch-size", "32",
             "--affinity-batches", "1", *MODEL]  # fmt: skip
HUGE = str(10**30)
PREPROCESS = """\
[[preprocess]]
transform = "Normalize"
features = ["user_age"]
fit = true
"""
_ERROR = re.compile(r"^recpipe( [a-z-]+)*: error: ")


@dataclass
class Done:
    argv: list[str]
    returncode: int
    stderr: str


def recpipe(argv: list[str], *, stdout: str = os.devnull, no_dac: bool = False) -> Done:
    """Run ``recpipe --quiet *argv`` (as root without the DAC capabilities if ``no_dac``)."""
    argv = [str(a) for a in argv]
    command = [sys.executable, "-m", "recpipe_cli", "--quiet", *argv]
    if no_dac and os.geteuid() == 0:
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("NUMBA_CACHE_DIR", str(REPO / ".numba_cache"))
    env.pop("RECPIPE_TOKEN", None)
    with open(stdout, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=REPO, start_new_session=True)  # fmt: skip
        try:
            _, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"`recpipe {' '.join(argv)}` still ran after {TIMEOUT} s")
    return Done(argv, proc.returncode, err)


def assert_refused(done: Done, *names: str) -> None:
    """A non-zero exit, no traceback, one error line naming one of ``names``."""
    shown = f"`recpipe {' '.join(done.argv)}` (exit {done.returncode}):\n{done.stderr[-3000:]}"
    assert done.returncode > 0, shown
    assert "Traceback" not in done.stderr, shown
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if lines and lines[0].startswith("usage: "):  # an argparse error: usage block, then the line
        lines = lines[next((i for i, x in enumerate(lines) if _ERROR.match(x)), 0) :]
    errors = [line for line in lines if not line.startswith("hint: ")]
    assert len(errors) == 1 and _ERROR.match(errors[0]), shown
    assert any(str(name) in errors[0] for name in names), f"names none of {names}: {shown}"


# --------------------------------------------------------------------------------------------
# data and places
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A ~1k-row dataset, its raw logs, a tower plan and a preprocessing config."""
    root = tmp_path_factory.mktemp("hostile")
    dataset = synthetic_dataset(root, requests=1000, seed=5, files=1, row_group_size=64)
    sparse = default_schema().sparse_names  # two towers of the dataset's sparse features
    towers = [sparse[: len(sparse) // 2], sparse[len(sparse) // 2 :]]
    plan = "".join(f"[[tower]]\nfeatures = {list(t)!r}\n\n" for t in towers)
    (root / "plan.toml").write_text(plan)
    (root / "preprocess.toml").write_text(PREPROCESS)
    return {
        "ds": dataset,
        "raw": root / "raw" / "features",
        "events": root / "raw" / "events",
        "plan": root / "plan.toml",
        "prep": root / "preprocess.toml",
    }


def _run_tool(*argv: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        return subprocess.CompletedProcess(argv, 127, "", str(exc))


class Places:
    """Makes hostile directories (``make(kind, seed=...)``) and undoes them at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounts: list[Path] = []
        self.locked: list[Path] = []

    def make(self, kind: str, *, seed: Path | None = None) -> Path:
        """A directory of ``kind`` holding a copy of ``seed`` (under its name), if given."""
        place = self.root / f"{kind}-{len(self.mounts) + len(self.locked)}"
        place.mkdir()
        size = (_size(seed) if seed else 0) + (1 << 20)
        if kind == "unwritable":
            _need_no_dac(self.root)
            self._copy(seed, place)
            self.locked.append(place)
            for folder in [place, *(p for p in place.rglob("*") if p.is_dir())]:
                folder.chmod(0o555)
        elif kind == "readonly":
            self._mount(place, f"size={size}")
            self._copy(seed, place)
            self._remount_ro(place)
        elif kind == "full":
            self._mount(place, f"size={size}")
            self._copy(seed, place)
            _fill(place / "filler")
        else:
            raise ValueError(kind)
        return place

    def _copy(self, seed: Path | None, place: Path) -> None:
        if seed is not None:
            shutil.copytree(seed, place / seed.name)

    def _mount(self, place: Path, options: str) -> None:
        done = _run_tool("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(place))
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        self.mounts.append(place)

    def _remount_ro(self, place: Path) -> None:
        done = _run_tool("mount", "-o", "remount,ro", str(place))
        assert done.returncode == 0, done.stderr

    def close(self) -> None:
        for place in self.locked:
            for folder in [place, *(p for p in place.rglob("*") if p.is_dir())]:
                folder.chmod(0o755)
        for place in reversed(self.mounts):
            if _run_tool("umount", str(place)).returncode != 0:
                _run_tool("umount", "-l", str(place))


def _size(path: Path) -> int:
    return sum(p.stat().st_size + 4096 for p in path.rglob("*"))


def _fill(path: Path) -> None:
    """Write ``path`` until its file system is full."""
    with open(path, "wb", buffering=0) as fh:
        chunk = b"\0" * (1 << 16)
        while True:
            try:
                fh.write(chunk)
            except OSError:
                break
        for _ in range(16):  # the last partial chunk's pages
            try:
                fh.write(b"\0" * 512)
            except OSError:
                break


_NO_DAC: dict[str, str | None] = {}


def _need_no_dac(root: Path) -> None:
    """Skip unless a subprocess here honours mode bits (as root: ``setpriv`` can drop them)."""
    if "reason" not in _NO_DAC:
        probe = root / "no-dac-probe"
        probe.mkdir()
        probe.chmod(0o555)
        code = f"open({str(probe / 'x')!r}, 'w')"
        command = [sys.executable, "-c", code]
        if os.geteuid() == 0:
            command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *command]
        done = _run_tool(*command)
        probe.chmod(0o755)
        _NO_DAC["reason"] = (
            None
            if "PermissionError" in done.stderr
            else f"a subprocess here ignores mode bits (root without setpriv?): {done.stderr[-300:]}"
        )
    if _NO_DAC["reason"]:
        pytest.skip(_NO_DAC["reason"])


@pytest.fixture
def places(tmp_path):
    made = Places(tmp_path)
    yield made
    made.close()


# --------------------------------------------------------------------------------------------
# every command against each kind of output
# --------------------------------------------------------------------------------------------

# (case, argv, seed): {out} is the hostile directory, {ds}, {raw}, ... the data, {seeded} the
# copy of the data named by seed made in the hostile directory before it was locked or filled
WRITERS = [
    ("synth", ["synth", "--out", "{out}/synth", "--requests", "200", "--files", "1"], None),
    ("etl-shard", ["etl", "shard", "{raw}", "--out", "{out}/shards", "--num-shards", "2"], None),
    ("etl-build", ["etl", "build", "{raw}", "--events", "{events}", "--out", "{out}/ds"], None),
    ("etl-infer-schema", ["etl", "infer-schema", "{raw}", "--out", "{out}/schema.toml"], None),
    ("stats", ["stats", "{ds}", "--out", "{out}/stats", "--no-plots"], None),
    ("fit", ["fit", "{seeded}", "--preprocess", "{prep}"], "ds"),  # writes into its dataset
    ("fit-out", ["fit", "{ds}", "--preprocess", "{prep}", "--out", "{out}/fitted.json"], None),
    ("train-checkpoint", ["train", "{ds}", *TRAIN, "--checkpoint", "{out}/ck"], None),
    ("predict", ["predict", "{checkpoint}", "{ds}", "--out", "{out}/p.parquet"], None),
    ("export", ["export", "{checkpoint}", "--out", "{out}/model.pt"], None),
    ("towers-partition", [*PARTITION, "--out", "{out}/plan.toml"], None),
    ("towers-train", ["towers", "train", "{ds}", "--towers", "{plan}", *TRAIN,
                      "--json", "{out}/s.json"], None),
]  # fmt: skip
FAST = {"synth", "etl-shard", "etl-build", "etl-infer-schema", "stats"}
# Commands whose only output is stdout: run with stdout on /dev/full.
PRINTERS = [
    ("etl-validate", ["etl", "validate", "{raw}"]),
    ("etl-verify", ["etl", "verify", "{ds}", "--json"]),
    ("stats-json", ["stats", "{ds}", "--no-plots", "--json", "--out", "{tmp}/stats"]),
    ("store-json", ["store", "{store}", "--json"]),
]


def _argv(template: list[str], **paths: object) -> list[str]:
    return [part.format(**paths) for part in template]


def _slow_unless(fast: bool):
    return () if fast else (pytest.mark.slow,)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("argv", "seed"),
    [pytest.param(a, s, id=c, marks=_slow_unless(c in FAST)) for c, a, s in WRITERS],
)
def test_an_output_that_cannot_be_written_is_one_line(data, places, request, kind, argv, seed):
    place = places.make(kind, seed=data[seed] if seed else None)
    paths = dict(data, out=place, seeded=place / data[seed].name if seed else None)
    if "{checkpoint}" in argv:
        paths["checkpoint"] = request.getfixturevalue("checkpoint")
    done = recpipe(_argv(argv, **paths), no_dac=kind == "unwritable")
    assert_refused(done, place)


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory) -> Path:
    """The checkpoint of a one-step ``recpipe train`` run on the dataset (for ``predict``)."""
    path = tmp_path_factory.mktemp("hostile_checkpoint") / "ck"
    done = recpipe(["train", data["ds"], *TRAIN, "--checkpoint", path])
    assert done.returncode == 0, done.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A small embedding store with one checkpoint."""
    import torch

    from trainer.store import EmbeddingStore, StoreConfig

    path = tmp_path_factory.mktemp("hostile_store") / "s"
    with EmbeddingStore.create(path, StoreConfig(dim=4, chunk_rows=8)) as made:
        loc = made.prefetch(torch.arange(20).numpy())
        made.push(loc, made.pull(loc) + 0.1)
        made.update()
        made.checkpoint(0).result()
    return path


@pytest.mark.parametrize(
    "argv",
    [pytest.param(a, id=c, marks=_slow_unless(c != "store-json")) for c, a in PRINTERS],
)
def test_a_full_stdout_is_one_line(data, request, tmp_path, argv):
    paths = dict(data, tmp=tmp_path)
    if "{store}" in argv:
        paths["store"] = request.getfixturevalue("store")
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    done = recpipe(_argv(argv, **paths), stdout="/dev/full")
    assert_refused(done, "<stdout>")


# --------------------------------------------------------------------------------------------
# nonsense values, a few per option family
# --------------------------------------------------------------------------------------------

PROC = "/proc/recpipe-nope"
# (case, argv, what the error line must name); {out} is a fresh directory's path
NONSENSE = [
    # sizes and counts: negative, zero, huge
    ("synth-requests-negative", ["synth", "--out", "{out}/s", "--requests", "-5"], "--requests"),
    ("synth-requests-huge", ["synth", "--out", "{out}/s", "--requests", HUGE], "--requests"),
    ("synth-files-zero", ["synth", "--out", "{out}/s", "--files", "0"], "--files"),
    ("shard-num-shards-zero", ["etl", "shard", "{raw}", "--out", "{out}/s", "--num-shards", "0"],
     "--num-shards"),
    ("shard-num-shards-huge", ["etl", "shard", "{raw}", "--out", "{out}/s", "--num-shards", HUGE],
     "--num-shards"),
    ("shard-buffer-mb-negative", ["etl", "shard", "{raw}", "--out", "{out}/s", "--buffer-mb",
                                  "-1"], "--buffer-mb"),
    ("shard-max-line-bytes-zero", ["etl", "shard", "{raw}", "--out", "{out}/s",
                                   "--max-line-bytes", "0"], "--max-line-bytes"),
    ("build-row-group-size-zero", ["etl", "build", "{raw}", "--out", "{out}/d",
                                   "--row-group-size", "0"], "--row-group-size"),
    ("build-threads-negative", ["etl", "build", "{raw}", "--out", "{out}/d", "--threads", "-2"],
     "--threads"),
    ("build-zstd-level-huge", ["etl", "build", "{raw}", "--out", "{out}/d", "--zstd-level",
                               HUGE], "--zstd-level"),
    ("build-memory-limit-tiny", ["etl", "build", "{raw}", "--out", "{out}/d", "--memory-limit",
                                 "1KB"], "--memory-limit"),
    ("build-memory-limit-word", ["etl", "build", "{raw}", "--out", "{out}/d", "--memory-limit",
                                 "lots"], "--memory-limit"),
    ("build-session-gap-negative", ["etl", "build", "{raw}", "--out", "{out}/d",
                                    "--session-gap=-5m"], "--session-gap"),
    ("validate-sample-zero", ["etl", "validate", "{raw}", "--sample", "0"], "--sample"),
    ("infer-schema-sample-zero", ["etl", "infer-schema", "{raw}", "--out", "{out}/s.toml",
                                  "--sample", "0"], "--sample"),
    ("stats-batch-size-zero", ["stats", "{ds}", "--out", "{out}/s", "--batch-size", "0"],
     "--batch-size"),
    ("stats-threads-negative", ["stats", "{ds}", "--out", "{out}/s", "--threads", "-1"],
     "--threads"),
    ("serve-batch-size-zero", ["serve", "{ds}", "--batch-size", "0"], "--batch-size"),
    ("serve-port-huge", ["serve", "{ds}", "--port", "70000"], "--port"),
    ("train-batch-size-zero", ["train", "{ds}", *TRAIN, "--batch-size", "0"], "--batch-size"),
    ("predict-batch-size-zero", ["predict", "{ds}", "{ds}", "--metrics-only", "--batch-size",
                                 "0"], "--batch-size"),
    ("train-steps-negative", ["train", "{ds}", *TRAIN, "--steps", "-1"], "--steps"),
    ("train-embedding-dim-zero", ["train", "{ds}", *TRAIN, "--embedding-dim", "0"],
     "--embedding-dim"),
    ("train-num-embeddings-huge", ["train", "{ds}", *TRAIN, "--num-embeddings", HUGE],
     "--num-embeddings"),
    ("train-workers-negative", ["train", "{ds}", *TRAIN, "--workers", "-1"], "--workers"),
    ("train-master-port-huge", ["train", "{ds}", *TRAIN, "--nproc", "2", "--master-port",
                                "99999"], "--master-port"),
    ("train-num-embeddings-too-many", ["train", "{ds}", *TRAIN, "--num-embeddings", str(10**15)],
     "out of memory"),  # torch's allocator refuses 16 PB: one line, though not naming the flag
    ("train-bottom-mlp-zero", ["train", "{ds}", *TRAIN, "--bottom-mlp", "0"], "--bottom-mlp"),
    ("towers-count-zero", ["towers", "partition", "{ds}", "--towers", "0", "--out",
                           "{out}/p.toml"], "--towers"),
    ("towers-ranks-per-host-zero", ["towers", "train", "{ds}", "--towers", "{plan}", *TRAIN,
                                    "--ranks-per-host", "0"], "--ranks-per-host"),
    # floats: NaN and infinities
    ("synth-bad-fraction-nan", ["synth", "--out", "{out}/s", "--bad-fraction", "nan"],
     "--bad-fraction"),
    ("synth-mean-session-len-inf", ["synth", "--out", "{out}/s", "--mean-session-len", "inf"],
     "--mean-session-len"),
    ("build-sample-sessions-nan", ["etl", "build", "{raw}", "--out", "{out}/d",
                                   "--sample-sessions", "nan"], "--sample-sessions"),
    ("build-fail-missing-share-inf", ["etl", "build", "{raw}", "--out", "{out}/d",
                                      "--fail-missing-share", "inf"], "--fail-missing-share"),
    ("fit-eval-fraction-nan", ["fit", "{ds}", "--preprocess", "{prep}", "--eval-fraction", "nan"],
     "--eval-fraction"),
    ("serve-handshake-timeout-nan", ["serve", "{ds}", "--handshake-timeout", "nan"],
     "--handshake-timeout"),
    ("train-lr-nan", ["train", "{ds}", *TRAIN, "--lr", "nan"], "--lr"),
    ("train-lr-inf", ["train", "{ds}", *TRAIN, "--lr", "inf"], "--lr"),
    ("train-eval-fraction-nan", ["train", "{ds}", *TRAIN, "--eval-fraction", "nan"],
     "--eval-fraction"),
    ("train-dist-timeout-nan", ["train", "{ds}", *TRAIN, "--nproc", "2", "--dist-timeout",
                                "nan"], "--dist-timeout"),
    ("towers-balance-nan", ["towers", "partition", "{ds}", "--towers", "2", "--balance", "nan",
                            "--out", "{out}/p.toml"], "--balance"),
    ("towers-compression-inf", ["towers", "train", "{ds}", "--towers", "{plan}", *TRAIN,
                                "--compression", "inf"], "--compression"),
    # unknown enum strings
    ("shard-by-bogus", ["etl", "shard", "{raw}", "--out", "{out}/s", "--by", "bogus"], "--by"),
    ("build-engine-bogus", ["etl", "build", "{raw}", "--out", "{out}/d", "--engine", "bogus"],
     "--engine"),
    ("build-master-bogus", ["etl", "build", "{raw}", "--out", "{out}/d", "--engine", "spark",
                            "--master", "bogus://x"], "--master"),
    ("serve-dispatch-bogus", ["serve", "{ds}", "--dispatch", "bogus"], "--dispatch"),
    ("train-optimizer-bogus", ["train", "{ds}", *TRAIN, "--optimizer", "bogus"], "--optimizer"),
    ("train-device-tpu", ["train", "{ds}", *TRAIN, "--device", "tpu"], "--device"),
    ("train-attention-bogus", ["train", "{ds}", *TRAIN, "--attention", "bogus"], "--attention"),
    ("towers-strategy-bogus", ["towers", "partition", "{ds}", "--towers", "2", "--strategy",
                               "bogus", "--out", "{out}/p.toml"], "--strategy"),
    ("towers-tower-module-bogus", ["towers", "train", "{ds}", "--towers", "{plan}", *TRAIN,
                                   "--tower-module", "bogus"], "--tower-module"),
    # paths under /proc: an input that is not there, an output that cannot be made
    ("synth-out-proc", ["synth", "--out", PROC + "/s"], PROC),
    ("shard-input-proc", ["etl", "shard", PROC, "--out", "{out}/s"], PROC),
    ("build-out-proc", ["etl", "build", "{raw}", "--out", PROC + "/d"], PROC),
    ("build-spill-dir-proc", ["etl", "build", "{raw}", "--out", "{out}/d", "--spill-dir",
                              PROC + "/spill"], PROC),
    ("validate-input-proc", ["etl", "validate", PROC], PROC),
    ("infer-schema-out-proc", ["etl", "infer-schema", "{raw}", "--out", PROC + "/s.toml"], PROC),
    ("verify-proc", ["etl", "verify", "/proc/self"], "/proc/self"),
    ("stats-out-proc", ["stats", "{ds}", "--out", PROC + "/s"], PROC),
    ("serve-dataset-proc", ["serve", PROC], PROC),
    ("train-checkpoint-proc", ["train", "{ds}", *TRAIN, "--checkpoint", PROC + "/ck"], PROC),
    ("predict-out-proc", ["predict", "{ds}", "{ds}", "--out", PROC + "/p.parquet"], PROC),
    ("export-out-proc", ["export", "{ds}", "--out", PROC + "/model.pt"], PROC),
    ("store-proc", ["store", PROC], PROC),
    ("towers-plan-proc", ["towers", "train", "{ds}", "--towers", PROC, *TRAIN], PROC),
]  # fmt: skip
# The cases that load torch (or start reader processes) before they refuse.
SLOW_NONSENSE = {
    "serve-batch-size-zero",
    "serve-port-huge",
    "serve-handshake-timeout-nan",
    "serve-dispatch-bogus",
    "serve-dataset-proc",
    "fit-eval-fraction-nan",
    "train-master-port-huge",
    "train-attention-bogus",
    "train-num-embeddings-too-many",
    "train-checkpoint-proc",
    "towers-plan-proc",
}


@pytest.mark.parametrize(
    ("argv", "name"),
    [pytest.param(a, n, id=c, marks=_slow_unless(c not in SLOW_NONSENSE)) for c, a, n in NONSENSE],
)
def test_a_nonsense_value_is_one_line(data, tmp_path, argv, name):
    done = recpipe(_argv(argv, out=tmp_path / "out", **data))
    assert_refused(done, name)


def test_every_command_is_covered():
    """Each command and stage of ``recpipe --help`` has cases above (a new one must get some)."""
    argvs = [a for _, a, _ in WRITERS] + [a for _, a in PRINTERS] + [a for _, a, _ in NONSENSE]
    commands = _subcommands(build_parser())
    assert {a[0] for a in argvs} == set(commands)
    for name in ("etl", "towers"):
        assert {a[1] for a in argvs if a[0] == name} == set(_subcommands(commands[name])), name
    assert {c for c, _, _ in NONSENSE} >= SLOW_NONSENSE and {c for c, _, _ in WRITERS} >= FAST


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
