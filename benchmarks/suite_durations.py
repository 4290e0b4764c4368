"""A pytest plugin for `benchmarks/suite_time.py`: every test phase's duration (setup, call, teardown), outcome,
worker and end, one JSON line each, appended to the file `GRPO_DIST_SUITE_DURATIONS` names. Loaded with `-p
suite_durations` (this folder on the path); with pytest-xdist only the controlling process writes them, so a test's
phases are counted once. Each process also writes its pid and the worker it is (`gw0`, ...; `controller`; `serial`
where one process runs the tests), for `benchmarks/process_accounting.py`."""

from __future__ import annotations

import json
import os

WRITES = {"enabled": False}


def pytest_configure(config) -> None:
    WRITES["enabled"] = bool(os.environ.get("GRPO_DIST_SUITE_DURATIONS")) and not hasattr(config, "workerinput")
    if os.environ.get("GRPO_DIST_SUITE_DURATIONS"):  # which process runs which worker's tests (`--accounting`)
        if hasattr(config, "workerinput"):
            worker = config.workerinput["workerid"]
        else:  # pytest-xdist's controller runs none; without it, this process runs them all
            worker = "controller" if getattr(config.option, "numprocesses", None) else "serial"
        _append({"pid": os.getpid(), "worker": worker})


def _append(line: dict) -> None:
    with open(os.environ["GRPO_DIST_SUITE_DURATIONS"], "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_runtest_logreport(report) -> None:
    if WRITES["enabled"]:
        line = {
            "test": report.nodeid,
            "when": report.when,
            "seconds": round(report.duration, 3),
            "outcome": report.outcome,
            "worker": report.node.gateway.id if hasattr(report, "node") else None,  # xdist's gw0; None: serial
            "ended": round(report.stop, 3),  # when the phase ended (time.time())
        }
        _append(line)
