"""`python -m grpo_dist` is the `grpo-dist` command."""

import sys

from grpo_dist.cli import main

sys.exit(main())
