"""Loading learner weights into a running vLLM engine.

`WeightReceiver` is mixed into vLLM's worker (`worker_extension_cls`), so `LLM.collective_rpc("receive_weights")`
runs inside the worker that owns the model. The weights arrive as a name -> tensor mapping in Hugging Face
parameter names: through Ray's object store, so every generator on a node reads one shared copy.
"""

from __future__ import annotations

import torch

WORKER_EXTENSION = f"{__name__}.WeightReceiver"


class WeightReceiver:
    """Methods added to each vLLM worker (`self` is the worker: it has `model_runner`)."""

    def receive_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load full (unsharded) Hugging Face weights into the engine's model; returns how many were loaded."""
        model = self.model_runner.model
        loaded = model.load_weights(weights=iter(state_dict.items()))
        expected = {name for name, _ in model.named_parameters()}
        missing = expected - set(loaded)
        if missing:
            raise RuntimeError(f"weight sync left {len(missing)} engine parameters unset, e.g. {sorted(missing)[:3]}")
        return len(loaded)
