"""What the vLLM engine alone takes for a step's batch: the floor under a step's `time/generate`.

    .venv/bin/python benchmarks/engine_floor.py [--config configs/quickstart.yaml] [--repeat 15] [key=value ...]

Builds the config's model and prompts (`grpo_dist.run.inputs.prepare`) and one `Generator` in this process (the
generator actor's own class and engine settings, without Ray), then samples the config's step batch
(`data.prompts_per_step` prompts, `rollout.group_size` completions each, its temperature and length, every prompt's
group one request, seeded, with per-token log-probabilities) `--repeat` times, all prompts at once, as a step does.
The same batch is then sampled straight from the engine with one cost taken away at a time: no per-request seeds,
no log-probabilities, no detokenizing, all three, and with vLLM's batching limits raised to the whole batch
(`max_num_seqs`, `max_num_batched_tokens`; an engine of its own). Prints one JSON line per way (median and fastest
seconds a batch) with its ratio to the generator's. Run it on an otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_dist.config import load_config  # noqa: E402
from grpo_dist.run.inputs import prepare  # noqa: E402


async def timed(batch, repeat: int) -> dict[str, float]:
    """Median and fastest seconds of `batch()` (awaited), after two warm-up calls."""
    for _ in range(2):
        await batch()
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        await batch()
        seconds.append(time.perf_counter() - started)
    return {"median_s": round(statistics.median(seconds), 4), "fastest_s": round(min(seconds), 4)}


def raw_batch(generator, prompts: list[list[int]], cfg, seeded: bool, logprobs: bool, detokenize: bool):
    """The step's batch sent to `generator`'s engine directly, with the costs asked for."""
    from vllm import SamplingParams

    rollout = cfg.rollout

    async def batch():
        calls = []
        for index, prompt in enumerate(prompts):
            params = SamplingParams(
                n=rollout.group_size, temperature=rollout.temperature, top_p=rollout.top_p,
                max_tokens=rollout.max_new_tokens, logprobs=0 if logprobs else None,
                seed=index if seeded else None, detokenize=detokenize,
            )  # fmt: skip
            calls.append(generator._sample(prompt, params))
        return await asyncio.gather(*calls)

    return batch


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    inputs = prepare(cfg)
    prompts = [record.token_ids for record in inputs.train[: cfg.data.prompts_per_step]]
    sequences = len(prompts) * cfg.rollout.group_size

    from grpo_dist.cluster.actors.generator import Generator

    generator = Generator(inputs.model_path, cfg.rollout, cfg.run.seed)
    await generator.start()

    async def as_a_step():
        return await asyncio.gather(
            *(generator.generate(prompt, cfg.rollout.group_size, None, index, index) for index, prompt in
              enumerate(prompts))
        )  # fmt: skip

    found = {"generator": await timed(as_a_step, args.repeat)}
    ways = {
        "no seeds": (False, True, True),
        "no log-probs": (True, False, True),
        "no detokenizing": (True, True, False),
        "none of the three": (False, False, False),
    }
    found["engine as the generator asks"] = await timed(
        raw_batch(generator, prompts, cfg, True, True, True), args.repeat
    )
    for name, costs in ways.items():
        found[name] = await timed(raw_batch(generator, prompts, cfg, *costs), args.repeat)
    await generator.close()

    import vllm.engine.arg_utils as arg_utils

    base = arg_utils.AsyncEngineArgs.__init__
    limits = {"max_num_seqs": sequences, "max_num_batched_tokens": max(sequences * 64, 8192)}

    def raised(self, *positional, **settings):
        base(self, *positional, **{**settings, **limits})

    arg_utils.AsyncEngineArgs.__init__ = raised
    wide = Generator(inputs.model_path, cfg.rollout, cfg.run.seed)
    await wide.start()
    found[f"batching limits raised ({sequences} sequences)"] = await timed(
        raw_batch(wide, prompts, cfg, True, True, True), args.repeat
    )
    await wide.close()
    reference = found["generator"]["median_s"]
    for name, figures in found.items():
        print(json.dumps({"way": name, "sequences": sequences, **figures,
                          "ratio": round(figures["median_s"] / reference, 3)}))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
