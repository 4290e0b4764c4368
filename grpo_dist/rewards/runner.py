"""Running reward functions on completions: in a sandbox process (`reward.sandbox`, the default) or in threads of
the calling process. The reward workers, the pre-flight check and `grpo-dist sft` all score through a `RewardRunner`,
so user reward code runs the same way (and under the same limits) wherever it is called from.

The built-ins that run the model's code (`config.MODEL_CODE_REWARDS`: `code_tests`) are called here, in the trusted
process: each run of the model's code is jailed (`grpo_dist.sandbox.jail`), and this side alone reads its verdict."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from grpo_dist.config import MODEL_CODE_REWARDS, RewardConfig, runs_model_code
from grpo_dist.rewards.code import MEMORY_MB
from grpo_dist.rewards.registry import BUILTIN_REWARDS, call_kwargs, combine, resolve_reward, score_one, to_score
from grpo_dist.sandbox import Limits, Sandbox
from grpo_dist.types import Failure

log = logging.getLogger("grpo_dist")


class RewardRunner:
    """The reward functions `names` (built-ins or dotted paths), ready to score; raises `ValueError` naming the
    first that does not resolve (or, in the sandbox, `SandboxError`). `reap`: see `Sandbox` (a reward worker's
    runner). `wait=False`: the sandbox starts while the caller goes on; `ready` waits for it (and raises).
    `warm_builtins=False`: the sandbox leaves the built-in rewards' warm-ups to their first calls (`Sandbox`)."""

    def __init__(
        self, names: list[str], reward: RewardConfig, reap: bool = False, wait: bool = True, warm_builtins: bool = True
    ) -> None:
        self.names, self.timeout_s = names, reward.timeout_s
        self.sandbox: Sandbox | None = None
        self.executor = None
        isolation = reward.isolation
        if isolation == "auto":  # a config validated resolves it; a runner built from a bare RewardConfig does here
            isolation = "require" if runs_model_code(names) else "best_effort"
        self.jailed = {index: resolve_reward(name) for index, name in enumerate(names) if name in MODEL_CODE_REWARDS}
        # The jail's settings (`config.JAIL_SETTINGS`), from the config alone: passed last, over kwargs and fields.
        memory_mb = min(reward.sandbox_memory_mb, MEMORY_MB)
        self.jail_settings = {"isolation": isolation, "memory_mb": memory_mb, "budget_s": reward.timeout_s}
        if reward.sandbox:
            limits = Limits(
                reward.sandbox_memory_mb,
                reward.timeout_s,
                reward.sandbox_processes,
                reward.sandbox_network,
                isolation == "require",
                tuple(reward.sandbox_env),
                tuple(reward.sandbox_paths),
            )
            in_server = [name in BUILTIN_REWARDS and name not in MODEL_CODE_REWARDS for name in names]
            self.sandbox = Sandbox(names, limits, reap, wait=False, warm_builtins=warm_builtins, in_server=in_server)
            if wait:
                self.ready()
        else:
            self.functions = [resolve_reward(name) for name in names]
            # Threads stuck in timed-out calls stay busy; spare ones keep scoring until half are stuck, when
            # `exhausted` says so (a reward worker is then replaced).
            self.threads = 4 * len(names)
            self.executor = TrackingExecutor(max_workers=self.threads, thread_name_prefix="reward")

    def score(
        self,
        functions: list[int],
        weights: list[float],
        kwargs: list[dict[str, Any]],
        prompt: str,
        completion: str,
        fields: dict[str, Any],
    ) -> tuple[float, list[float], list[Failure | None]]:
        """`functions` (indices into `names`) on one completion, called as `f(prompt, completion,
        **call_kwargs(fields, kwargs))` (a jailed built-in with its jail's settings over both): (weighted sum, each
        score, each failure or None); a failed call scores NaN, saying why and of what kind (the caller decides
        whether it scores a floor: `registry.with_floors`)."""
        return next(self.score_each(functions, weights, kwargs, [(prompt, completion, fields)]))

    def score_each(
        self,
        functions: list[int],
        weights: list[float],
        kwargs: list[dict[str, Any]],
        completions: Sequence[tuple[str, str, dict[str, Any]]],
    ) -> Iterator[tuple[float, list[float], list[Failure | None]]]:
        """`score` of each of `completions` (prompt, completion, fields), in order, each as its calls are answered.
        Where the sandbox makes every call, all completions' calls are asked together (`Sandbox.answers`), and the
        caller takes each score as it comes (a call asked ahead runs while the caller works: see `answers`). Where a
        call is made here (a jailed built-in), each completion's sandbox calls are answered before it."""
        if self.sandbox is None and not self.jailed:
            chosen = [self.functions[index] for index in functions]
            for prompt, completion, fields in completions:
                yield score_one(chosen, weights, kwargs, prompt, completion, fields, self.timeout_s, self.executor)
            return
        in_sandbox = [] if self.sandbox is None else [index for index in functions if index not in self.jailed]

        def sandbox_calls(prompt: str, completion: str, fields: dict[str, Any]) -> list[tuple]:
            return [
                (index, prompt, completion, call_kwargs(fields, extra))
                for index, extra in zip(functions, kwargs, strict=True)
                if index in in_sandbox
            ]

        if in_sandbox and len(in_sandbox) == len(functions):  # every call in the sandbox: all asked together
            answers = self.sandbox.answers(
                [call for each in completions for call in sandbox_calls(*each)], self.timeout_s
            )
            for _ in completions:
                scores, errors = zip(*(next(answers) for _ in functions), strict=True)
                yield combine(list(scores), weights), list(scores), list(errors)
            return
        for prompt, completion, fields in completions:  # a call made here too: its sandbox's calls answered first
            calls = sandbox_calls(prompt, completion, fields)
            answered = iter(list(self.sandbox.answers(calls, self.timeout_s)) if calls else [])
            scores, errors = [], []
            for index, extra in zip(functions, kwargs, strict=True):
                if index in in_sandbox:
                    score, error = next(answered)
                elif index in self.jailed:
                    score, error = self._jailed(
                        index, prompt, completion, call_kwargs(fields, extra, self.jail_settings)
                    )
                else:
                    chosen = [self.functions[index]]
                    _, [score], [error] = score_one(
                        chosen, [1.0], [extra], prompt, completion, fields, self.timeout_s, self.executor
                    )
                scores.append(score)
                errors.append(error)
            yield combine(scores, weights), scores, errors

    def _jailed(self, index: int, prompt: str, completion: str, kwargs: dict[str, Any]) -> tuple[float, Failure | None]:
        """A jailed built-in on one completion, within `reward.timeout_s` (what it has not done by then fails, so
        a completion cannot escape a low score by being slow): (score, None), or (NaN, why it has none). What the
        model's code does (a crash, a limit, a time-out) fails its tests and is scored; the built-in itself raises
        only for the row or the machine (no tests, no jail), which is no failure of the completion's."""
        try:
            return to_score(self.jailed[index](prompt, completion, **kwargs)), None
        except Exception as error:  # a row without tests, no jail on this node: this completion unscored
            return math.nan, Failure("unscorable", f"{type(error).__name__}: {error}")

    def ready(self) -> None:
        """Wait until the sandbox has imported the functions, saying once what the machine did not allow."""
        if self.sandbox is not None and self.sandbox.starting is not None:
            self.sandbox.ready()
            for note in self.sandbox.notes:
                log.warning(note)

    @property
    def exhausted(self) -> bool:
        """Whether half the threads are stuck in calls past their limit (never in the sandbox: it is killed)."""
        return self.executor is not None and 2 * len(self.executor.unfinished) >= self.threads

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)


class TrackingExecutor(ThreadPoolExecutor):
    """A thread pool that knows its unfinished calls: after scoring, those are calls stuck past their limit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unfinished: set[Future] = set()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        future = super().submit(*args, **kwargs)
        self.unfinished.add(future)
        future.add_done_callback(self.unfinished.discard)
        return future
