"""Checkpoints are read without running code from them: a file that would run a command when unpickled is refused,
naming what it holds, and the command never runs; the run state's own classes load."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from grpo_dist.run.checkpoints import RUN_STATE_CLASSES
from grpo_dist.run.rollouts.rollout import Rollout
from grpo_dist.storage import safe_load
from grpo_dist.types import Completion, Failure, Score


class RunsACommand:
    """Unpickled by a plain `torch.load(weights_only=False)`, it would create `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "run_state.pt"
    torch.save({"step": 3, "payload": RunsACommand(str(marker))}, path)
    with pytest.raises(safe_load.UnsafeCheckpoint, match=r"run_state.pt: holds posix.system besides tensors"):
        safe_load.load(path, RUN_STATE_CLASSES)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what an unchecked load does: the check above can tell
    assert marker.exists()


def test_the_run_states_own_classes_load(tmp_path):
    completion = Completion(0, [1, 2], [3], "3", [-0.5], "stop", 2)
    floored = Score(0.0, [0.0], {"f": Failure("timeout", "timed out after 10s")})  # a failed call scored its floor
    state = {
        "step": 4,
        "ahead": {"batch": (5, Rollout([], [completion] * 2, [Score(1.0, [1.0]), floored]))},
        "random": {},
    }
    path = tmp_path / "run_state.pt"
    torch.save(state, path)
    assert safe_load.load(path, RUN_STATE_CLASSES) == state


def test_a_run_state_written_before_the_rollout_batch_moved_loads(tmp_path, monkeypatch):
    """A run state pickled when `Rollout` lived in `grpo_dist.rollouts.rollout` (before the subpackages) still loads,
    as the class it is now; under a name the allowed list does not give, the same file is refused."""
    completion = Completion(0, [1, 2], [3], "3", [-0.5], "stop", 2)
    rollout = Rollout([], [completion], [Score(1.0, [1.0])])
    old = types.ModuleType("grpo_dist.rollouts.rollout")
    old.Rollout = Rollout
    monkeypatch.setitem(sys.modules, "grpo_dist.rollouts.rollout", old)
    monkeypatch.setattr(Rollout, "__module__", "grpo_dist.rollouts.rollout")
    path = tmp_path / "run_state.pt"
    torch.save({"step": 2, "ahead": {"batch": (3, rollout)}}, path)
    monkeypatch.undo()
    assert b"grpo_dist.rollouts.rollout" in path.read_bytes()
    loaded = safe_load.load(path, RUN_STATE_CLASSES)["ahead"]["batch"][1]
    assert type(loaded) is Rollout and loaded == rollout
    with pytest.raises(safe_load.UnsafeCheckpoint, match=r"holds grpo_dist.rollouts.rollout.Rollout besides"):
        safe_load.load(path, [cls for cls in RUN_STATE_CLASSES if not isinstance(cls, tuple)])
