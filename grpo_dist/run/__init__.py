"""The run's loop and what watches it, in the driver's process.

- `driver`: the GRPO loop, one screen: prompts -> groups -> rewards -> advantages -> train -> sync -> log.
- `inputs`: everything a run reads, checked before any actor starts (model, tokenizer, data, rewards, judges).
- `rollouts`: the step's batch, generated and scored on time or drawn ahead under bounded staleness.
- `recovery`: resuming from a checkpoint, restarting the learner group, rolling back an unhealthy step.
- `checkpoints`: what a checkpoint holds and how it is written and read; `metrics`: the metrics and samples
  logged each step (files, W&B); `evaluation`: held-out accuracy; `health`: the divergence guard; `autoscale`:
  the generator count from the step's timing; `sft`: supervised warm start.

May import: `cluster` and everything below it (never `cli` or `ops`).
"""
