"""Loading learner weights into a running vLLM engine.

`WeightReceiver` is mixed into vLLM's worker (`worker_extension_cls`), so `collective_rpc("receive_weights_file")`
runs inside the worker that owns the model. The weights arrive in Hugging Face parameter names, in a safetensors
file the generator wrote to shared memory from Ray's object store (every generator on a node reads one shared
copy), and go through vLLM's own in-place reload, which handles fused layers (qkv, gate/up) and weight
post-processing.
"""

from __future__ import annotations

import logging
import time

from grpo_dist.transports.gloo import reload_warnings_quiet  # also registers the gloo engine in each worker

log = logging.getLogger("grpo_dist")

WORKER_EXTENSION = f"{__name__}.WeightReceiver"


class WeightReceiver:
    """Methods added to each vLLM worker (`self` is the worker: it has `model_runner`)."""

    def receive_weights_file(self, path: str) -> float:
        """Load full (unsharded) Hugging Face weights from a safetensors file into the engine's model; returns the
        seconds the reload took (the file read left out)."""
        from safetensors.torch import load_file

        state_dict = load_file(path)
        started = time.perf_counter()
        with reload_warnings_quiet():
            self.model_runner.reload_weights(weights_iterator=iter(state_dict.items()))
        return time.perf_counter() - started

    def reload_initial_weights(self) -> None:
        """Load the initial model's weights from disk again (a fault injected: `faults.inject.drop_weights`)."""
        with reload_warnings_quiet():
            self.model_runner.reload_weights()

    def apply_weight_update(self, update_info: dict) -> dict:
        """One whole broadcast update (gloo): close one a failed sync left open, start, receive and load, finish.
        Returns the transfer engine's report (with delta sync, the checksum of its copy)."""
        self.close_abandoned_update()
        self.start_weight_update()
        self.update_weights(update_info)
        self.finish_weight_update()
        return self.weight_transfer_engine.report

    def close_abandoned_update(self) -> bool:
        """End a broadcast update that a failed sync left open (its sender or a peer was lost mid-way), so that the
        next one can start; the next sync overwrites whatever it had loaded. Returns whether one was open."""
        if not getattr(self, "_weight_update_active", False):
            return False
        try:
            self.finish_weight_update()
        except Exception as err:  # the half-loaded weights are replaced by the update that follows
            log.warning(
                "closing an abandoned weight update failed (%s: %s); the next update reloads every weight",
                type(err).__name__,
                err,
            )
            self._weight_update_active = False
            self.weight_transfer_engine.reset_weight_update_target()
        return True
