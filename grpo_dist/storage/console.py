"""What a run shows on its console: a line for each section (inputs, starting the actors, training, an evaluation,
a checkpoint), one line per step, faults and errors. What the libraries and the actors print besides (vLLM,
DeepSpeed, Ray, transformers, Python warnings: every actor's output) goes to `verbose.log` in the run directory;
`--verbose` shows it on the console as well. Once a run took the actors' output (Ray prints it in the driver), it
stays off the console for the life of the process.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

LIBRARY_LOGGERS = (
    "ray",
    "vllm",
    "DeepSpeed",
    "deepspeed",
    "transformers",
    "torch",
    "datasets",
    "huggingface_hub",
    "wandb",
    "urllib3",
    "filelock",
    "py.warnings",
)
LOG_NAME = "verbose.log"
RAY_PRINTER = "ray_print_logs"  # the name of the handler Ray's driver prints its actors' output with
OWN_PRINTER = "grpo_dist_verbose_log"


class Console:
    """Where the libraries' and actors' output goes for one run: `verbose.log` (`open`), and the console too when
    `verbose`."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.file: TextIO | None = None
        self.handler: logging.Handler | None = None
        self.console_handler = logging.StreamHandler(sys.stderr)  # verbose: for loggers that have no console one

    def open(self, run_dir: Path) -> None:
        """Send the libraries' logs and Python's warnings to `run_dir/verbose.log` (and not to the console unless
        verbose). Call again after a library is imported: one that installs its own console handler then (vLLM,
        DeepSpeed) is taken in too."""
        if self.file is None:
            self.file = (run_dir / LOG_NAME).open("a", buffering=1)
            self.handler = logging.StreamHandler(self.file)
            self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.captureWarnings(True)
        if not self.verbose:
            _quiet_progress_bars()
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            if not self.verbose:
                logger.handlers = [h for h in logger.handlers if not _to_console(h)]
            elif not any(_to_console(h) for h in logger.handlers):
                logger.addHandler(self.console_handler)  # what Python would have printed, printed still
            if self.handler not in logger.handlers:
                logger.addHandler(self.handler)
            logger.propagate = False

    def take_actor_output(self) -> None:
        """Once Ray is up in this process: the actors' output (which Ray's driver prints) goes to the log file, and
        to the console too only when verbose."""
        if self.file is None:
            return
        try:
            from ray._private import worker
        except ImportError:  # another Ray: its output stays on the console
            return
        dispatcher, file = worker.global_worker_stdstream_dispatcher, self.file

        def to_file(data: dict) -> None:
            worker.print_worker_logs(data, file, False)

        if not self.verbose:
            dispatcher.remove_handler(RAY_PRINTER)
        dispatcher.remove_handler(OWN_PRINTER)
        dispatcher.add_handler(OWN_PRINTER, to_file)

    def close(self) -> None:
        """The libraries' logs and Python's warnings stop going to the log file. The actors' output keeps going to
        it: what they printed last reaches this process after the run (until a next run in this
        process takes it; the file is closed with the process)."""
        if self.file is None:
            return
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).removeHandler(self.handler)
            logging.getLogger(name).removeHandler(self.console_handler)
        logging.captureWarnings(False)
        self.file.flush()


class ReaderGone:
    """Standard output that outlives its reader: once the pipe it writes to is closed (`grpo-dist train ... | head`),
    what is written is dropped instead of raising in the middle of a run; everything else is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text) or len(text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, call, *args):
        if self.gone:
            return None
        try:
            return call(*args)
        except BrokenPipeError:
            self.gone = True  # and no error when Python flushes at exit: the descriptor now leads nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            return None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_a_closed_reader() -> None:
    """Have this process's standard output drop what it writes once its reader is gone (`ReaderGone`)."""
    if not isinstance(sys.stdout, ReaderGone):
        sys.stdout = ReaderGone(sys.stdout)


def _quiet_progress_bars() -> None:
    """transformers' and the hub's own bars (writing a model's shards, downloading one)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return
    transformers_logging.disable_progress_bar()


def _to_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
        sys.stdout,
        sys.stderr,
        sys.__stdout__,
        sys.__stderr__,
    )


def section(text: str) -> None:
    """A line saying what the run does now."""
    tqdm.write(f"== {text}")


def bar(total: int, what: str, unit: str) -> tqdm:
    """A progress bar for a long wait, on a terminal only (a log file gets no bar), gone when done."""
    return tqdm(total=total, desc=what, unit=unit, leave=False, disable=None, dynamic_ncols=True)


def step_line(step: int, steps: int, metrics: dict[str, float], staleness: bool) -> str:
    """`step 3/100  reward 0.512  kl 0.0012  1234 tok/s  2.1 s` (and the staleness with k >= 1)."""
    width = len(str(steps))
    parts = [
        f"step {step:>{width}}/{steps}",
        f"reward {metrics['reward/mean']:.3f}",
        f"kl {metrics.get('kl', 0.0):.4f}",
        f"{metrics['tokens_per_s']:.0f} tok/s",
        f"{metrics['time/step']:.1f} s",
    ]
    if staleness and "staleness/max" in metrics:
        parts.append(f"staleness {metrics['staleness/max']:.0f}")
    return "  ".join(parts)
