"""A Spark standalone cluster on this machine: a master and workers from the installed PySpark.

:func:`standalone_cluster` starts ``spark-class org.apache.spark.deploy.master.Master`` and
``...deploy.worker.Worker`` processes (PySpark ships both, with its own ``spark-class``), on
free ports of ``127.0.0.1``, on the Java that :func:`etl.spark_env.java_home` finds, and yields
the master URL (``spark://127.0.0.1:PORT``) once every worker has registered. Each process runs
in a process group of its own, and every group is killed when the ``with`` block ends, however
it ends (an error, a timeout, an interrupt); starting is bounded by ``timeout`` seconds.

It is what the Spark tests and ``benchmarks/etl.py --spark`` run ``etl build --engine spark``
on, to show a real cluster (executors in JVMs of their own, apart from the driver) builds the
dataset ``local[N]`` builds; it is no way to run a production cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from etl.spark_env import java_home
from recpipe._deps import optional_import
from recpipe.errors import RecpipeError

__all__ = ["free_port", "standalone_cluster"]


def free_port() -> int:
    """A TCP port of ``127.0.0.1`` that nothing listens on (as the kernel chose it just now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            state = json.loads(r.read())
    except (OSError, ValueError):
        return -1
    return int(state.get("aliveworkers", 0))


@contextlib.contextmanager
def standalone_cluster(
    work_dir: str | Path,
    *,
    workers: int = 2,
    cores: int = 1,
    memory: str = "2g",
    timeout: float = 180.0,
) -> Iterator[str]:
    """Run a standalone master and ``workers`` workers for the ``with`` block.

    Args:
        work_dir: where the processes' logs and the workers' folders go.
        workers: worker processes (each runs one executor of a job).
        cores: cores each worker offers.
        memory: memory each worker offers (an executor asks 1g by default).
        timeout: seconds to wait for the master and every worker to be up.

    Yields:
        The master URL, ``spark://127.0.0.1:PORT``.

    Raises:
        RecpipeError: PySpark or Java is missing, or the cluster did not come up in time
            (the message names the log to read).
    """
    pyspark = optional_import("pyspark", purpose="a Spark standalone cluster")
    spark_home = Path(pyspark.__file__).parent
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "JAVA_HOME": str(java_home()),
        "SPARK_HOME": str(spark_home),
        "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_NO_DAEMONIZE": "1",
    }
    port, ui = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    procs: list[tuple[subprocess.Popen, Path]] = []

    def start(name: str, args: list[str]) -> None:
        log = work / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(spark_home / "bin" / "spark-class"), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=work,
                start_new_session=True,  # its JVM in a group of its own: killed with it
            )
        procs.append((proc, log))

    try:
        start(
            "master",
            [
                *("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"),
                *("--port", str(port), "--webui-port", str(ui)),
            ],
        )
        for i in range(workers):
            folder = work / f"worker-{i}"
            folder.mkdir(exist_ok=True)
            start(
                f"worker-{i}",
                [
                    *("org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1"),
                    *("--port", str(free_port()), "--webui-port", str(free_port())),
                    *("--cores", str(cores), "--memory", memory, "--work-dir", str(folder), url),
                ],
            )
        deadline = time.monotonic() + timeout
        while _alive_workers(ui) < workers:
            for proc, log in procs:
                if proc.poll() is not None:
                    raise RecpipeError(
                        f"the Spark standalone cluster did not start: {log.name} ended with "
                        f"code {proc.returncode}\nhint: read {log}"
                    )
            if time.monotonic() > deadline:
                raise RecpipeError(
                    f"the Spark standalone cluster did not start in {timeout:.0f} s "
                    f"({max(0, _alive_workers(ui))} of {workers} workers registered)\n"
                    f"hint: read the logs in {work}"
                )
            time.sleep(0.5)
        yield url
    finally:
        for proc, _ in reversed(procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc, _ in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
