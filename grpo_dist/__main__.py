"""`python -m grpo_dist` is the `grpo-dist` command."""

import sys


def main() -> int:
    """The command: a run's driver forked warm where `grpo-dist up` keeps a cluster (`grpo_dist.cluster.warm_driver`),
    else run here."""
    from grpo_dist.cluster import warm_driver

    if (code := warm_driver.run(sys.argv[1:])) is not None:
        return code
    from grpo_dist.cli import main as run_here

    return run_here()


if __name__ == "__main__":
    sys.exit(main())
