"""What an operator does to a run from outside it: `submit` (a run as a Ray job, its logs and its stop), `plot`
(a run's curves from its metrics), `export` (its policy as a Hugging Face model, LoRA merged).

May import: `run` and everything below it, never `cli`.
"""
