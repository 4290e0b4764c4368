"""Per-step metrics: what a rollout batch looked like, and where they go: metrics.jsonl, eval.jsonl and
completions.jsonl in the run directory, and W&B (every key against the training step, histograms, completion tables).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_dist.config import Config
from grpo_dist.storage import jsonl
from grpo_dist.storage.status import EVENTS
from grpo_dist.types import Completion, Score

if TYPE_CHECKING:
    from grpo_dist.run.rollouts import Rollout


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean/std/min/max of the finite entries (NaN when none)."""
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return {f"{prefix}/{name}": math.nan for name in ("mean", "std", "min", "max")}
    std = values.std(unbiased=False) if values.numel() > 1 else torch.tensor(0.0)
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/std": std.item(),
        f"{prefix}/min": values.min().item(),
        f"{prefix}/max": values.max().item(),
    }


def rollout_metrics(
    completions: list[Completion], scores: list[Score], advantages: torch.Tensor, reward_names: list[str]
) -> dict[str, float]:
    """Reward, per-function reward, advantage and length statistics of one rollout batch."""
    totals = torch.tensor([score.total for score in scores])  # [B]
    per_function = torch.tensor([score.per_function for score in scores])  # [B, F]
    lengths = torch.tensor([c.sampled_tokens for c in completions], dtype=torch.float)  # [B]
    metrics = {**_stats("reward", totals), **_stats("advantage", advantages), **_stats("response_length", lengths)}
    for column, name in enumerate(reward_names):
        metrics[f"reward/{name}"] = _stats("r", per_function[:, column])["r/mean"]
    metrics["reward/unscored"] = float((~torch.isfinite(totals)).sum())
    metrics["response_length/clipped_fraction"] = sum(c.finish_reason == "length" for c in completions) / len(
        completions
    )
    metrics["tokens/generated"] = float(lengths.sum())
    metrics["rollout/weight_version"] = float(min(c.weight_version for c in completions))
    return metrics | episode_metrics(completions)


def episode_metrics(completions: list[Completion]) -> dict[str, float]:
    """Of multi-turn trajectories: turns, tool calls, tool errors and tool seconds per trajectory (mean), the
    slowest trajectory's tool seconds, the share of tool calls that failed, the share of trajectories cut, and how
    many trajectories failed (`agent/failed`: their environment, tool parser or agent raised)."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    count, calls = len(episodes), sum(e.tool_calls for e in episodes)
    return {
        "agent/turns": sum(e.turns for e in episodes) / count,
        "agent/tool_calls": calls / count,
        "agent/tool_errors": sum(e.tool_errors for e in episodes) / count,
        "agent/tool_error_fraction": sum(e.tool_errors for e in episodes) / calls if calls else 0.0,
        "agent/tool_seconds": sum(e.tool_seconds for e in episodes) / count,
        "agent/tool_seconds_max": max(e.tool_seconds for e in episodes),
        "agent/truncated_fraction": sum(e.truncated for e in episodes) / count,
        "agent/diverged_fraction": sum(e.diverged for e in episodes) / count,
        "agent/failed": float(sum(e.failure is not None for e in episodes)),
    }


def conversation(completion: Completion) -> str:
    """What the completion table shows of a completion: its text, or a trajectory's whole conversation after its
    first messages, one `role: content` line a message."""
    if completion.episode is None:
        return completion.text
    first = next((i for i, m in enumerate(completion.episode.messages) if m["role"] == "assistant"), 0)
    return "\n".join(f"{m['role']}: {m['content']}" for m in completion.episode.messages[first:])


def completion_rows(rollout: Rollout, advantages: torch.Tensor, version: int, names: list[str], limit: int):
    """The first groups of a step's batch, whole, up to `limit` rows: what the W&B completion table shows and
    `completions.jsonl` keeps (prompt, completion, reward per function, advantage, staleness, generator)."""
    per_group = max(1, len(rollout.completions) // max(1, len(rollout.prompts)))
    count = max(per_group, limit // per_group * per_group)
    rows = []
    for index, (c, score) in enumerate(zip(rollout.completions[:count], rollout.scores[:count], strict=True)):
        rows.append(
            {
                "prompt": rollout.prompts[c.prompt_index].text,
                "completion": conversation(c),
                "reward": _json_number(score.total),
                **{
                    f"reward/{name}": _json_number(value) for name, value in zip(names, score.per_function, strict=True)
                },
                "advantage": _json_number(advantages[index].item()),
                "staleness": version - c.weight_version,
                "generator": c.generator,
                "length": c.sampled_tokens,
                **({"turns": c.episode.turns, "tool_calls": c.episode.tool_calls} if c.episode else {}),
                "finish_reason": c.finish_reason,
            }
        )
    return rows


@dataclass
class StepSamples:
    """The values of a step's W&B histograms, and its completion table's rows when one is due."""

    rewards: list[float]
    lengths: list[int]
    advantages: list[float]
    table: list[dict] | None = None


log = logging.getLogger("grpo_dist")

STEP_KEY = "train/step"
"""W&B's x-axis: the training step, logged with every row (W&B's own step only grows, so steps a resumed or
restarted run does again would otherwise be dropped)."""


class MetricsSink:
    """Writes one JSON object per step to `metrics.jsonl` (flushed every step), each evaluation to `eval.jsonl` and
    each completion table to `completions.jsonl`, and mirrors them to W&B."""

    FILES = ("metrics.jsonl", "eval.jsonl", "completions.jsonl")

    def __init__(
        self, run_dir: Path, wandb_run: Any | None, after_step: int = 0, finish_timeout_s: float = 120.0
    ) -> None:
        """`after_step`: a resumed run's last checkpointed step; rows after it (steps done again) are dropped.
        `finish_timeout_s`: the longest `close` waits for W&B to finish (`wandb.finish_timeout_s`)."""
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.first_step = after_step  # the step this run went on from (0: it started)
        if after_step:
            self._keep_until(after_step)
        self.files = {name: (run_dir / name).open("a") for name in self.FILES}
        self.wandb_run = wandb_run
        self.finish_timeout_s = finish_timeout_s
        if wandb_run is not None:
            where = f"offline, {Path(wandb_run.dir).parent}" if wandb_run.offline else wandb_run.url
            self.event("wandb", after_step, where)

    def rewind(self, step: int) -> None:
        """Drop the rows after `step`: the run goes back to it (a learner group restarted from a checkpoint)."""
        for file in self.files.values():
            file.close()
        self._keep_until(step)
        self.files = {name: (self.run_dir / name).open("a") for name in self.FILES}

    def _keep_until(self, step: int) -> None:
        """Keep the rows of `step` and before (a torn last line, from a crash mid-write, dropped), atomically."""
        for name in self.FILES:
            path = self.run_dir / name
            if path.exists():
                jsonl.rewrite(path, [row for row in jsonl.read_rows(path) if row.get("step", math.inf) <= step])

    def event(self, kind: str, step: int, message: str) -> None:
        """A line of the run's history for `grpo-dist status` (`events.jsonl`: a health event, a fault, the W&B run,
        the end), kept whatever the run goes back to."""
        row = {"time": time.time(), "step": step, "kind": kind, "message": message}
        try:
            with (self.run_dir / EVENTS).open("a") as file:
                file.write(json.dumps(row) + "\n")
        except OSError as err:  # the history is for reading; the run goes on (or stops as it was stopping)
            log.warning("could not write to %s (%s: %s)", EVENTS, type(err).__name__, err)

    def alert(self, title: str, text: str) -> None:
        """A W&B alert (an e-mail or Slack message, as the user set W&B up); a failure to send one is reported."""
        if self.wandb_run is None:
            return
        try:
            self.wandb_run.alert(title=title, text=text)
        except Exception as err:  # the run goes on; the event is printed and logged already
            log.warning("could not send a W&B alert (%s: %s)", type(err).__name__, err)

    @property
    def wandb_id(self) -> str | None:
        return None if self.wandb_run is None else self.wandb_run.id

    def log(self, step: int, metrics: dict[str, float], samples: StepSamples | None = None) -> None:
        """A step's metrics, histograms and completion table."""
        self._write("metrics.jsonl", {"step": step, **{key: _json_number(value) for key, value in metrics.items()}})
        for row in (samples.table or []) if samples else []:
            self._write("completions.jsonl", {"step": step, **row})
        if self.wandb_run is not None:
            self.wandb_run.log({**metrics, **_wandb_media(samples), STEP_KEY: step})

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation of the weights of `step` (0: before training), against that step in W&B."""
        self._write("eval.jsonl", {"step": step, **{key: _json_number(value) for key, value in metrics.items()}})
        if self.wandb_run is not None:
            self.wandb_run.log({**metrics, STEP_KEY: step})

    def _write(self, name: str, record: dict) -> None:
        self.files[name].write(json.dumps(record) + "\n")
        self.files[name].flush()

    def close(self) -> None:
        """Idempotent: the driver closes the sink after training and again on the way out."""
        for file in self.files.values():
            file.close()
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            finishing = threading.Thread(target=run.finish, name="wandb-finish", daemon=True)
            finishing.start()
            finishing.join(self.finish_timeout_s)
            if finishing.is_alive():  # a network that hangs must not hold the run's end (its processes, its exit)
                log.warning(
                    "W&B did not finish within %g s (wandb.finish_timeout_s); its files stay in %s (`wandb sync` "
                    "uploads them)",
                    self.finish_timeout_s,
                    self.path.parent / "wandb",
                )


def _wandb_media(samples: StepSamples | None) -> dict[str, Any]:
    """Histograms of the step's rewards, lengths and advantages, and its completion table when due."""
    if samples is None:
        return {}
    import wandb

    media = {}
    for key, values in (("rewards", samples.rewards), ("lengths", samples.lengths), ("advantages", samples.advantages)):
        finite = [value for value in values if math.isfinite(value)]
        if finite:
            media[f"histograms/{key}"] = wandb.Histogram(finite)
    if samples.table:
        columns = list(samples.table[0])
        media["completions"] = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in samples.table])
    return media


def _json_number(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def wandb_mode(mode: str) -> str:
    """`wandb.mode`, where auto follows W&B's own switches: WANDB_MODE when set (`dryrun` is offline), disabled with
    WANDB_DISABLED; else online where there are credentials (WANDB_API_KEY, or what `wandb login` stored in the netrc
    file for the W&B host), offline otherwise."""
    if mode != "auto":
        return mode
    chosen = os.environ.get("WANDB_MODE", "").strip().lower()
    if chosen:
        return {"dryrun": "offline", "run": "online"}.get(chosen, chosen)
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes"):
        return "disabled"
    return "online" if os.environ.get("WANDB_API_KEY") or _logged_in() else "offline"


def _logged_in() -> bool:
    """Whether `wandb login` left a key for the W&B host (WANDB_BASE_URL's, api.wandb.ai by default) in the netrc
    file (NETRC, else ~/.netrc)."""
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


def start_wandb(cfg: Config, run_dir: Path, run_id: str | None = None) -> Any | None:
    """A W&B run (offline into the run directory when no API key is set), or None when disabled; `run_id`
    continues that run (a resumed one). Says where to watch it: the run's page, or the offline directory and how
    to upload it."""
    settings = cfg.wandb
    mode = wandb_mode(settings.mode)
    if not settings.enabled or mode == "disabled":
        return None
    import wandb

    # A W&B service of its own: one inherited from a parent process (WANDB_SERVICE, which wandb sets for a process
    # that used it: a notebook, a test runner) outlives a run killed here and keeps its run id, refusing the resume.
    os.environ.pop("WANDB_SERVICE", None)
    run = wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=settings.name or cfg.run.name,
        group=settings.group,
        tags=settings.tags or None,
        notes=settings.notes,
        config=cfg.model_dump(mode="json"),
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=True),
    )
    run.define_metric(STEP_KEY)
    run.define_metric("*", step_metric=STEP_KEY)
    again = " (continued)" if run_id else ""
    if mode == "online":
        print(f"W&B run{again}: {run.url}", flush=True)
    else:
        offline_dir = Path(run.dir).parent
        print(f"W&B run{again} {run.id}, offline: {offline_dir} (upload: wandb sync {offline_dir})", flush=True)
    return run
