"""The run's actors: learner ranks, generators and reward workers, one engine each."""
