"""Methods mixed into vLLM's workers (``worker_extension_cls``): load weights sent by tandem.

This module is imported inside vLLM's worker processes; it needs nothing of tandem beyond itself.
"""

from __future__ import annotations

import inspect
import io

import torch


class TandemWorkerExtension:
    """vLLM mixes this class into each worker; ``self`` is the worker.

    A weight update arrives as buckets (:meth:`tandem_stage_weights`), then one call loads
    everything staged (:meth:`tandem_load_staged_weights`).
    """

    def tandem_parameter_dtypes(self) -> list[str]:
        """The dtypes of the model's parameters as they are now, e.g. ``["bfloat16"]`` (on CPUs
        with AMX, vLLM's GEMMs keep some biases in fp32: then ``["bfloat16", "float32"]``)."""
        model = self.model_runner.get_model()
        return sorted({str(param.dtype).removeprefix("torch.") for param in model.parameters()})

    def tandem_stage_weights(self, payload: bytes) -> int:
        """Keep a ``torch.save``-d ``{name: tensor}`` bucket (HF names) for the next load; returns how many."""
        named = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        staged = self.__dict__.setdefault("_tandem_staged", {})
        staged.update(named)
        return len(named)

    def tandem_load_staged_weights(self) -> int:
        """Load every staged tensor into the running model in place; returns how many."""
        staged = self.__dict__.pop("_tandem_staged", {})
        # reload_weights (not model.load_weights) restores layers whose weights vLLM repacked for
        # its kernels after the first load (e.g. CPU GEMMs), then processes them again.
        reload = self.model_runner.reload_weights
        if "weights_iterator" not in inspect.signature(reload).parameters:
            raise RuntimeError(
                "this vLLM's model runner reloads weights only from disk; tandem loads them from memory "
                "with reload_weights(weights_iterator=...), as vLLM 0.32 and later do (pip install -U vllm)"
            )
        reload(weights_iterator=iter(staged.items()), is_checkpoint_format=True)
        return len(staged)

    def tandem_load_weights(self, payload: bytes) -> int:
        """Stage one bucket and load it at once (a whole update in one message)."""
        self.tandem_stage_weights(payload)
        return self.tandem_load_staged_weights()
