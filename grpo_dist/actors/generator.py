"""Generator actor: one vLLM engine sampling groups of completions, versioned by the weights it holds."""

from __future__ import annotations

import os

from grpo_dist.actors import die_with_parent
from grpo_dist.config import RolloutConfig
from grpo_dist.types import Completion


def engine_environment() -> dict[str, str]:
    """Environment for a generator process, set before vLLM is imported: the engine core runs in-process
    (start-up in seconds, not tens), threads are not pinned (several engines may share the cores)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "TOKENIZERS_PARALLELISM": "false",
    }


class Generator:
    """Wraps one `vllm.LLM`. Wrapped as a Ray actor by `grpo_dist.cluster` (resources are given there)."""

    def __init__(self, model_path: str, rollout: RolloutConfig, seed: int, weight_transfer: str | None = None) -> None:
        """`weight_transfer`: the vLLM weight-transfer backend the broadcast transport uses ("gloo" or "nccl"),
        None when weights come through the object store."""
        die_with_parent()
        os.environ.update(engine_environment())
        import torch
        from vllm import LLM
        from vllm.config.weight_transfer import WeightTransferConfig

        from grpo_dist.actors.weight_sync import WORKER_EXTENSION

        self.rollout = rollout
        self.weight_version = 0
        self.llm = LLM(
            model=model_path,
            dtype=rollout.dtype,
            max_model_len=rollout.max_model_len,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            kv_cache_memory_bytes=None if torch.cuda.is_available() else int(rollout.cpu_kv_cache_gib * 2**30),
            enforce_eager=True,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config=WeightTransferConfig(backend=weight_transfer) if weight_transfer else None,
            tensor_parallel_size=rollout.tensor_parallel_size,
            distributed_executor_backend="ray" if rollout.tensor_parallel_size > 1 else None,
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """Two greedy tokens with their logprobs (the first request asking for logprobs costs seconds), so an
        engine's first-call costs fall in its start-up (bounded by `faults.start_timeout_s`), not in a step's
        generation (bounded by `faults.generate_timeout_s`)."""
        from vllm import SamplingParams, TokensPrompt

        warm_up = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0)
        self.llm.generate([TokensPrompt(prompt_token_ids=[0])], warm_up, use_tqdm=False)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        group_size: int,
        greedy: bool = False,
        first_index: int = 0,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """Sample `group_size` completions per prompt; prompt i of this call gets `prompt_index` first_index + i.
        With `seeds`, prompt i's samples use seeds[i], seeds[i] + 1, ... (vLLM's per-request seeds), so the same
        weights give the same completions whichever generator draws them."""
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(
                n=1 if greedy else group_size,
                temperature=0.0 if greedy else self.rollout.temperature,
                top_p=1.0 if greedy else self.rollout.top_p,
                max_tokens=self.rollout.max_new_tokens,
                logprobs=0,
                seed=None if seeds is None else seeds[i],
            )
            for i in range(len(prompt_token_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            self._completion(first_index + i, output.prompt_token_ids, sample)
            for i, output in enumerate(outputs)
            for sample in output.outputs
        ]

    def _completion(self, prompt_index: int, prompt_token_ids: list[int], sample) -> Completion:
        token_ids = list(sample.token_ids)
        # One {token_id: Logprob} dict per sampled token; with logprobs=0 it holds the sampled token.
        logprobs = [step[token].logprob for step, token in zip(sample.logprobs, token_ids, strict=True)]
        return Completion(
            prompt_index=prompt_index,
            prompt_token_ids=list(prompt_token_ids),
            token_ids=token_ids,
            text=sample.text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason or "length",
            weight_version=self.weight_version,
        )

    def load_weights(self, state_dict: dict, weight_version: int) -> int:
        """Load the learner's weights; completions sampled afterwards carry `weight_version`."""
        self.llm.collective_rpc("receive_weights", args=(state_dict,))
        self.llm.reset_prefix_cache()
        self.weight_version = weight_version
        return weight_version

    # The broadcast transport's control plane (`grpo_dist.transports.broadcast.GeneratorClient`): vLLM runs each
    # on every worker of the engine, where the weight-transfer engine lives.
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("close_abandoned_update")  # one a failed sync left open
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: int) -> None:
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        self.weight_version = weight_version

    def current_weight_version(self) -> int:
        return self.weight_version

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probability of each token of `token_ids` after the first, under the engine's current weights."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)
        steps = output.prompt_logprobs[1:]  # the first token has no logprob
        return [step[token].logprob for step, token in zip(steps, token_ids[1:], strict=True)]
