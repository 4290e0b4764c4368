"""`python tests/cli_batch.py ARGVS`: each command of ARGVS (a JSON list of argument lists) through `cli.main`, one
after another in this process, its output captured at the file descriptors; prints one JSON line, [exit code,
stdout, stderr] of each (`conftest.cli_batch`)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

from grpo_dist import cli


def run(argv: list[str]) -> list:
    """[exit code, stdout, stderr] of `grpo-dist ARGV` run here; a traceback is exit 1, as a process of its own."""
    stdout = sys.stdout
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            code = cli.main(argv)
        except SystemExit as exit:  # argparse's refusals
            code = exit.code if isinstance(exit.code, int) else 2
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout = stdout  # the command wraps it against a closed reader
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(kept[0], 1), os.dup2(kept[1], 2)
            os.close(kept[0]), os.close(kept[1])
        out.seek(0), err.seek(0)
        return [code, out.read(), err.read()]


if __name__ == "__main__":
    print(json.dumps([run(argv) for argv in json.loads(sys.argv[1])]))
