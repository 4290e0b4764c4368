"""The Ray side of a run: where its actors go, the pools that keep them, and the actors themselves.

- `cluster`: the run's actors by role (`Cluster`): started together, handed to a run, weights synced, the learner
  group restarted, the generator pool scaled.
- `ray_cluster`: joining Ray (`ray.address`, or the cluster `grpo-dist up` keeps) or starting it for the run.
- `ray_settings`: how the clusters grpo-dist starts differ from Ray's defaults (actors' priority, no Ray metrics).
- `placement`: the placement groups the config asks for, checked against what the cluster has.
- `generator_pool`, `reward_pool`, `teacher_pool`, `judge_pool`: the pools of vLLM engines, reward workers,
  distillation teachers and judge models, each replacing a faulty member.
- `learner_group`: the learner's DeepSpeed ranks as one group.
- `standing`: a local Ray cluster kept up between runs (`grpo-dist up` / `down`).
- `warm`, `warm_launch`: on the clusters grpo-dist starts here, actor processes forked from one that imported the
  stack once; `warm_driver`: on `grpo-dist up`'s, a run's driver forked from it too.
- `actors`: the actor classes (a generator and its engine process, a learner rank and its weights, a reward
  worker) and vLLM's plugin.

May import: `agents`, `rewards`, `transports`, `data`, `models`, `storage`, `sandbox` and below (never `run`).
"""
