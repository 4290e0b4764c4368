"""The settings of the Ray clusters grpo-dist starts itself (a run's local one, `grpo-dist up`; the tests' own), which
differ from Ray's defaults. A module of its own, without Ray: the commands and the tests read it before they import
Ray."""

from __future__ import annotations

WORKER_NICENESS = 0
"""The scheduling priority of the actors' processes on a cluster grpo-dist starts (a run's local one, `grpo-dist up`):
the driver's own. Ray's default, 15, lets any other busy process on the machine take the CPU from a run's
actors (a nice-0 process gets about 30 times their share): with one core kept busy beside it, the quick start's steps
took 3.90 s each, and 0.80 s at 0 (`benchmarks/contention.py --busy 1`)."""


METRICS_COLLECTION = False
"""Whether a cluster grpo-dist starts (a run's local one, `grpo-dist up`) collects Ray's own metrics. Neither serves a
dashboard to show them (a run's metrics are its own: metrics.jsonl, W&B), and the collection crashed processes: each
Ray process exports them from a thread of Ray's that reads the environment while the process's own threads write it
(vLLM and the driver set variables as they start), and a forked driver of the test suite died of SIGSEGV in that
thread (`opentelemetry::...::TemporalMetricStorage::buildMetrics`). Off, no process of the cluster opens that export."""


def cluster_environment() -> dict[str, str]:
    """The variables a cluster grpo-dist starts with `ray start` takes its settings from (`start_local_ray` passes the
    same as its system config): its actors at the driver's priority, and no Ray metrics."""
    return {"RAY_worker_niceness": str(WORKER_NICENESS), "RAY_enable_metrics_collection": str(int(METRICS_COLLECTION))}
