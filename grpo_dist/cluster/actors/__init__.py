"""The run's actors: learner ranks, generators and reward workers, one engine each.

A generator (`generator`, its engine process `engine`), a learner rank (`learner`, its weights and checkpoints
`learner_weights`), a reward worker (`reward_worker`), and the plugin vLLM loads in every engine process
(`engine_plugin`). Part of `grpo_dist.cluster`: may import what it may."""
