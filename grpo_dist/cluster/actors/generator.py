"""Generator actor: one vLLM asynchronous engine sampling groups of completions, versioned by the weights it holds.

The actor is asynchronous (a Ray async actor around vLLM's `AsyncLLM`): it serves many calls at once, each a few
prompts' groups (`generate_each`) or one (`generate`), and the engine batches whatever is running (continuous
batching). A weight update pauses the
engine with its requests kept, loads the weights and resumes; a request under way then samples its remaining tokens
with the new weights, and its completion records the oldest and newest weight versions its tokens were sampled by
(vLLM labels every output token with the version that sampled it). The KV cache such a request already holds was
computed under the old weights and is kept, as in PipelineRL (arXiv 2509.19128); the prefix cache is salted with
the weight version, so no new request reuses a prompt's cache from older weights.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import shutil
import tempfile
from pathlib import Path

from grpo_dist.cluster.actors.engine import (
    EngineStats,
    adapter_dir,
    eager,
    engine_dtype,
    engine_environment,
    fork_engine_core,
    kv_cache_bytes,
    shm_dir,
    sockets_dir,
)
from grpo_dist.config import EnvironmentConfig, InjectConfig, RolloutConfig
from grpo_dist.faults.inject import Injector
from grpo_dist.models.vision import opened, placeholder_ids, served_image_key
from grpo_dist.sandbox.privileges import die_with_parent
from grpo_dist.types import Completion, Sampling

ENGINE_STOP_S = 10.0
"""How long a generator's close waits for its engine's process to stop itself (on GPUs) and be gone (anywhere): within
the bound on a whole close (`grpo_dist.faults.CLOSE_S`)."""


class Generator:
    """Wraps one `AsyncLLM`. Wrapped as a Ray actor by `grpo_dist.cluster.generator_pool` (resources are given there);
    `start` must be awaited before any other call."""

    def __init__(
        self,
        model_path: str,
        rollout: RolloutConfig,
        seed: int,
        weight_transfer: str | None = None,
        environment: EnvironmentConfig | None = None,
        isolation: tuple[str, list[str]] = ("best_effort", []),
        adapters: tuple[int, int] | None = None,
        inject: InjectConfig | None = None,
    ) -> None:
        """`weight_transfer`: the vLLM weight-transfer backend the broadcast transport uses ("gloo" or "nccl"),
        None when weights come through the object store. `environment`: each completion is a multi-turn trajectory
        in it (`grpo_dist.agents`). `isolation`: `reward.isolation` and `reward.sandbox_env`, for its tools.
        `adapters`: (largest rank, versions held) when the engine serves LoRA adapters (`load_adapter`). `inject`:
        the faults the run injects (`faults.inject`; none by default)."""
        import torch

        die_with_parent()
        on_gpu = torch.cuda.is_available()
        self.on_gpu = on_gpu
        os.environ.update(engine_environment(eager(rollout, on_gpu)))
        from vllm import AsyncEngineArgs
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from grpo_dist.transports.weight_sync import WORKER_EXTENSION

        self.rollout = rollout
        self.banned = {token: -100.0 for token in placeholder_ids(model_path)} or None  # vLLM's strongest bias
        self.agent = None
        if environment is not None:
            from transformers import AutoTokenizer

            from grpo_dist.agents.episode import AgentLoop

            tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.agent = AgentLoop(environment, tokenizer, rollout.max_new_tokens, *isolation)
        self.weight_version = 0
        self.injected = Injector(inject or InjectConfig())
        self.adapters = adapters
        self.lora = None  # the adapter new requests are served with (a `LoRARequest`), when serving adapters
        self.held: dict[int, list[Path]] = {}  # weight version -> the directories of its loaded adapter, oldest first
        self.loads = 0  # adapters loaded so far
        self.adapter_lock = asyncio.Lock()
        self.held_back = asyncio.Lock()  # one group at a time under `faults.inject.slow_generation_file`
        self.salt = "0"  # the prefix cache's key of what is served: the version (and with adapters, which load)
        self.adapter_dir = adapter_dir() if adapters else None
        self.sockets_dir = os.environ["VLLM_RPC_BASE_PATH"] = sockets_dir()  # read as the engine is made
        self.request_ids = itertools.count()
        self.stats = EngineStats()
        if not on_gpu and rollout.tensor_parallel_size == 1:
            fork_engine_core()
            gc.freeze()  # the heap so far (vLLM, torch) left out of the forked engine core's collections (warm.serve)
        self.engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=model_path,
                dtype=engine_dtype(rollout, on_gpu),
                max_model_len=rollout.max_model_len,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_bytes(rollout, on_gpu),
                # On the CPU backend a seeded request whose prompt is cut between engine steps stops the engine
                # (its random generator cannot step back), so a prompt is always prefilled whole there.
                enable_chunked_prefill=None if on_gpu else False,
                enforce_eager=eager(rollout, on_gpu),
                seed=seed,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                weight_transfer_config=WeightTransferConfig(backend=weight_transfer) if weight_transfer else None,
                tensor_parallel_size=rollout.tensor_parallel_size,
                distributed_executor_backend="ray" if rollout.tensor_parallel_size > 1 else "uni",
                disable_log_stats=True,
                enable_lora=adapters is not None,
                **({"max_lora_rank": adapters[0], "max_loras": adapters[1]} if adapters else {}),
            ),
            usage_context=UsageContext.LLM_CLASS,  # batch sizes for offline batches, as `vllm.LLM` has
            stat_loggers=[self.stats.logger_factory()],  # vLLM's own schedulers' statistics, and no console log
        )

    async def start(self) -> None:
        """Label the initial weights version 0 and sample two greedy tokens with their logprobs (the first request
        asking for logprobs costs seconds), so an engine's first-call costs fall in its start-up (bounded by
        `faults.start_timeout_s`), not in a step's generation (bounded by `faults.generate_timeout_s`)."""
        from vllm import SamplingParams

        await self.engine.update_weight_version(str(self.weight_version))
        await self._sample([0], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))
        if self.agent is not None:
            await self.agent.start()

    async def configure(self, rollout: RolloutConfig, inject: InjectConfig) -> None:
        """A new run's rollout settings and the faults it injects; the engine's own (`ENGINE_SETTINGS`) are the ones
        it was started with."""
        self.rollout, self.injected = rollout, Injector(inject)

    async def close(self) -> None:
        """End the engine's process and the tools' sandboxes, and wait until they are gone (the pool calls it before
        killing the generator); remove the engine's sockets and adapters. On CPUs the engine's process is killed at
        once: stopping itself, it spends about a CPU second collecting its whole heap (vLLM's memory clean-up), which
        its end frees anyway. On GPUs it stops itself (at most `ENGINE_STOP_S`), releasing the device in order."""
        import psutil

        if self.agent is not None:
            self.agent.close()
        engine_processes = [child for child in psutil.Process().children() if "EngineCore" in " ".join(_title(child))]
        deadline = asyncio.get_running_loop().time() + ENGINE_STOP_S  # one bound for both waits
        self.engine.shutdown(timeout=ENGINE_STOP_S if self.on_gpu else 0)  # 0: vLLM kills its process tree
        await _ended(engine_processes, deadline - asyncio.get_running_loop().time())
        for directory in (self.adapter_dir, self.sockets_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    async def generate(
        self,
        prompt_token_ids: list[int],
        group_size: int,
        evaluation: Sampling | None,
        prompt_index: int,
        seed: int | None = None,
        row: dict | None = None,
        images: list[bytes] | None = None,
    ) -> list[Completion]:
        """One prompt's group: `group_size` samples, tagged `prompt_index`, sampled as `rollout` says or, for an
        evaluation, as `evaluation` says. With `seed` the samples use seed, seed + 1, ... (vLLM's per-request
        seeds), so the same weights give the same completions whichever generator draws them. With an environment
        each sample is a trajectory from `row` (its turns and fields), all G running at once. `images`: the prompt's
        images (PNG bytes, `grpo_dist.models.vision`), given to the engine as its multimodal input; the prompt's
        token ids hold one placeholder per image, which the engine expands to the image's tokens as the model's
        processor does (the completions' `prompt_token_ids` are the expanded prompt). Not with an environment."""
        from vllm import SamplingParams

        sampling = evaluation or Sampling(self.rollout.temperature, self.rollout.top_p, self.rollout.max_new_tokens)
        if images and self.agent is not None:
            raise ValueError("a prompt's images with an environment: an episode's turns take no images")
        if self.agent is not None:
            group = await self._trajectories(row, prompt_token_ids, group_size, sampling, prompt_index, seed)
        else:
            params = SamplingParams(
                n=group_size,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=0,
                seed=seed,
                logit_bias=self.banned,
            )
            output = await self._sample(prompt_token_ids, params, images)
            group = [self._completion(prompt_index, output.prompt_token_ids, sample) for sample in output.outputs]
        if delay_s := self.injected.generation_delay_s():
            async with self.held_back:
                await asyncio.sleep(delay_s)
        return group

    async def generate_each(
        self,
        prompts: list[tuple[list[int], int, int | None, dict | None, list[bytes] | None]],
        group_size: int,
        evaluation: Sampling | None,
    ) -> list[list[Completion]]:
        """`generate` of each of `prompts` (its token ids, prompt index, seed, row and images), all at once, one
        engine request each: their groups in order. One that fails stops the others (their engine requests aborted)
        and its error is the call's."""
        calls = [
            asyncio.create_task(self.generate(ids, group_size, evaluation, index, seed, row, images))
            for ids, index, seed, row, images in prompts
        ]
        try:
            return list(await asyncio.gather(*calls))
        except BaseException:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)  # their engine requests aborted before the error
            raise

    async def _trajectories(
        self,
        row: dict,
        prompt_token_ids: list[int],
        group_size: int,
        sampling: Sampling,
        prompt_index: int,
        seed: int | None,
    ) -> list[Completion]:
        """`group_size` trajectories from `row`, each advancing on its own; the group once all have ended. One whose
        user code raised comes back failed (no tokens after `prompt_token_ids`, `episode.failure`), the rest as
        they ended."""
        import asyncio
        import copy

        from vllm import SamplingParams

        from grpo_dist.agents.protocol import Sampled

        async def sample(prefix: list[int], max_tokens: int, turn_seed: int | None) -> Sampled:
            params = SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                logprobs=0,
                max_tokens=min(max_tokens, sampling.max_tokens),
                seed=turn_seed,
                logit_bias=self.banned,
            )
            (turn,) = (await self._sample(prefix, params)).outputs
            return Sampled(list(turn.token_ids), _logprobs(turn), turn.finish_reason or "length", self._versions(turn))

        seeds = [None if seed is None else seed + number for number in range(group_size)]
        rows = [copy.deepcopy(row) for _ in seeds]  # each its own: an environment may change what it is given
        trajectories = await asyncio.gather(
            *(self.agent.trajectory(r, sample, each, prompt_token_ids) for r, each in zip(rows, seeds, strict=True))
        )
        return [
            Completion(
                prompt_index=prompt_index,
                prompt_token_ids=t.prompt_token_ids,
                token_ids=t.token_ids,
                text=t.text,
                logprobs=t.logprobs,
                finish_reason=t.finish_reason,
                mask=t.mask,
                episode=t.episode,
                **self._version_fields(t.versions),
            )
            for t in trajectories
        ]

    def _versions(self, sample) -> list[int]:
        """The weight versions that sampled any of a sample's tokens (serving adapters: the one its request had)."""
        if self.adapters is not None:
            return [sample.adapter_version]
        return [int(span.version) for span in sample.weight_versions or [] if span.end > span.start]

    def _version_fields(self, versions: list[int]) -> dict[str, int | None]:
        """`weight_version` (the oldest) and `newest_weight_version` (when another) of a completion."""
        return {
            "weight_version": min(versions, default=self.weight_version),
            "newest_weight_version": max(versions) if len(set(versions)) > 1 else None,
        }

    async def _sample(self, prompt_token_ids: list[int], params, images: list[bytes] | None = None):
        """The engine's final output for one request (with its prompt's images, when it has any)."""
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        version, lora, salt = self.weight_version, self.lora, self.salt  # a request keeps the adapter it started with
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids, cache_salt=salt)
        if images:
            prompt["multi_modal_data"] = {"image": opened(images)}
            prompt["multi_modal_uuids"] = {"image": [served_image_key(image, salt) for image in images]}
        async for output in self.engine.generate(prompt, params, str(next(self.request_ids)), lora_request=lora):
            final = output
        for sample in final.outputs:
            sample.adapter_version = version
        return final

    def _completion(self, prompt_index: int, prompt_token_ids: list[int], sample) -> Completion:
        return Completion(
            prompt_index=prompt_index,
            prompt_token_ids=list(prompt_token_ids),
            token_ids=list(sample.token_ids),
            text=sample.text,
            logprobs=_logprobs(sample),
            finish_reason=sample.finish_reason or "length",
            **self._version_fields(self._versions(sample)),
        )

    async def load_weights(self, state_dict: dict, weight_version: int) -> float:
        """Load the learner's full weights (the object-store transport); tokens sampled afterwards carry
        `weight_version`. They reach the engine's process through a file in shared memory. Returns the seconds the
        engine took to load them."""
        from safetensors.torch import save_file

        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=shm_dir()) as weights:
            save_file({name: tensor.contiguous() for name, tensor in state_dict.items()}, weights.name)
            await self._pause()
            (seconds, *_) = await self.engine.collective_rpc("receive_weights_file", args=(weights.name,))
        await self._resume(weight_version)
        return seconds

    async def load_adapter(self, adapter: tuple[dict, dict], weight_version: int) -> tuple[int, int]:
        """Serve the learner's LoRA adapter (its weights by PEFT name and its config's fields, from the object
        store) as `weight_version` to every request from now on; requests under way keep theirs. The newest
        `rollout.max_staleness` + 1 versions stay loaded (pinned), older ones are removed. No pause: the base is not
        touched. A version sent again (after a failed check, a reconnect, a learner restarted from a checkpoint)
        replaces its adapter in place, and new requests use a prefix cache of their own. Returns the adapter's
        elements and bytes."""
        from vllm.lora.request import LoRARequest

        from grpo_dist.models.lora import write_adapter

        weights, config = adapter
        async with self.adapter_lock:  # one load at a time: a resend may come while a timed-out one still runs
            self.loads += 1
            path = Path(self.adapter_dir) / f"v{weight_version}.{self.loads}"
            staging = path.with_name(f".{path.name}")
            sent = write_adapter(weights, config, staging)
            staging.rename(path)  # whole, or not there
            name, lora_id = f"v{weight_version}", weight_version + 1
            await self.engine.add_lora(LoRARequest(name, lora_id, str(path), load_inplace=True))
            await self.engine.pin_lora(lora_id)
            served = LoRARequest(name, lora_id, str(path))  # requests carry this one: no reload at each step
            self.held.setdefault(weight_version, []).append(path)
            self.held[weight_version] = self.held.pop(weight_version)  # now the newest
            # The new version first, then the old ones out: no request is sent with an adapter being removed.
            self.lora = None if self.injected.drops(weight_version) else served  # an adapter dropped (`faults.inject`)
            self.weight_version, self.salt = weight_version, f"{weight_version}.{self.loads}"
            for version in list(self.held)[: max(0, len(self.held) - (self.adapters[1] - 1))]:
                await self.engine.remove_lora(version + 1)
                for stale in self.held.pop(version):
                    shutil.rmtree(stale, ignore_errors=True)
        return sum(tensor.numel() for tensor in weights.values()), sent

    async def adapters_loaded(self) -> list[int]:
        """The weight versions whose adapters the engine holds now (asked of vLLM), oldest first."""
        return sorted(lora_id - 1 for lora_id in await self.engine.list_loras())

    async def _pause(self) -> None:
        """Stop scheduling, the requests under way kept where they are."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def _resume(self, weight_version: int) -> None:
        """After new weights are in: tokens sampled from now on are labelled `weight_version`, new requests use
        its prefix cache, and scheduling goes on (the older prefix cache is freed where no request holds it)."""
        if self.injected.drops(weight_version):  # an engine serving other weights than it was sent (`faults.inject`)
            await self.engine.collective_rpc("reload_initial_weights")
        await asyncio.gather(self.engine.reset_prefix_cache(), self.engine.update_weight_version(str(weight_version)))
        self.weight_version, self.salt = weight_version, str(weight_version)
        await self.engine.resume_generation()

    # The broadcast transport's control plane (`grpo_dist.transports.broadcast.GeneratorClient`): vLLM runs each
    # on every worker of the engine, where the weight-transfer engine lives.
    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self) -> None:
        await self._pause()
        await self.engine.collective_rpc("close_abandoned_update")  # one a failed sync left open
        await self.engine.start_weight_update()

    async def apply_weight_update(self, update_info: dict, weight_version: int) -> list[dict]:
        """A whole weight update in one call (the gloo engine's): pause with requests kept, let every worker
        receive and load the weights, resume labelled `weight_version`. Returns each worker's report."""
        # The pause goes out first and the update right behind it, without waiting for the pause's answer (which
        # comes back tens of milliseconds later): the engine takes its calls in order, so it is paused before the
        # update starts.
        # (vLLM sends a call's message before its first wait, so one turn of the loop sends the pause.)
        paused = asyncio.ensure_future(self._pause())
        await asyncio.sleep(0)  # the pause's message is sent
        try:
            reports = await self.engine.collective_rpc("apply_weight_update", args=(update_info,))
        finally:
            await paused  # a failed update leaves the engine paused: the next update resumes it
        await self._resume(weight_version)
        return reports

    async def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, weight_version: int) -> None:
        await self.engine.finish_weight_update()
        await self._resume(weight_version)

    async def engine_stats(self) -> dict[str, float]:
        """vLLM's scheduler statistics since the last call (KV-cache use, running and waiting requests at their
        highest, preemptions), and the memory this engine holds: the in-use memory of the GPU this actor was
        given (what vLLM reserved, with whatever else runs on it), or on a CPU the resident memory of this
        process. With tensor parallelism the engine's workers hold its GPUs, and no memory is reported."""
        import psutil
        import ray
        import torch

        found = self.stats.take()
        if ray.get_gpu_ids():
            free, total = torch.cuda.mem_get_info()
            found["memory_gb"] = (total - free) / 1e9
        elif not torch.cuda.is_available():
            found["memory_gb"] = psutil.Process().memory_info().rss / 1e9
        return found

    async def judge(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        """Greedy replies to `prompts` (token ids), all at once: a judge engine's verdicts."""
        from vllm import SamplingParams

        outputs = await self._sample_each(prompts, lambda: SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return [output.outputs[0].text for output in outputs]

    async def token_logprobs(self, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
        """A teacher engine's judgement: for each (token ids, start), the log-probability of every token from
        `start` on after the tokens before it (the model's own distribution, at temperature 1), all at once."""
        from vllm import SamplingParams

        prompts = [tokens for tokens, _ in sequences]
        outputs = await self._sample_each(prompts, lambda: SamplingParams(max_tokens=1, prompt_logprobs=0))
        return [
            [output.prompt_logprobs[at][tokens[at]].logprob for at in range(start, len(tokens))]  # the first is None
            for output, (tokens, start) in zip(outputs, sequences, strict=True)
        ]

    async def _sample_each(self, prompts: list[list[int]], params) -> list:
        """The engine's final output for each of `prompts`, all under way at once, each with its own `params()`
        (a request's sampling parameters are set on it by `_sample`)."""
        import asyncio

        return await asyncio.gather(*(self._sample(prompt, params()) for prompt in prompts))

    async def current_weight_version(self) -> int:
        """The weights it holds; raises vLLM's `EngineDeadError` when its engine core is gone (the probe that finds
        a generator whose process lives but whose engine died: `faults.as_fault`)."""
        await self.engine.check_health()
        return self.weight_version

    async def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probability of each token of `token_ids` after the first, under the engine's current weights."""
        from vllm import SamplingParams

        output = await self._sample(token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
        steps = output.prompt_logprobs[1:]  # the first token has no logprob
        return [step[token].logprob for step, token in zip(steps, token_ids[1:], strict=True)]


def _logprobs(sample) -> list[float]:
    """[T] the sampling logprob of each token of a vLLM sample: its logprobs hold one {token_id: Logprob} dict per
    sampled token, with logprobs=0 just the sampled token's."""
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)]


async def _ended(processes: list, timeout_s: float) -> None:
    """Wait until each of `processes` has ended, at most `timeout_s` in all (a zombie has ended: what it held is freed,
    and its owner reaps it)."""
    import psutil

    deadline = asyncio.get_running_loop().time() + timeout_s
    for process in processes:
        while asyncio.get_running_loop().time() < deadline:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            await asyncio.sleep(0.02)


def _title(process) -> list[str]:
    """A process's title (vLLM titles its engine's `VLLM::EngineCore`), empty once it has ended."""
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []
