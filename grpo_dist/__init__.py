"""grpo-dist: distributed GRPO training with Ray, vLLM and DeepSpeed."""
