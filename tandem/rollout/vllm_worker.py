"""Methods mixed into vLLM's workers (``worker_extension_cls``): load weights sent by tandem.

This module is imported inside vLLM's worker processes; it needs nothing of tandem beyond itself.
"""

from __future__ import annotations

import io

import torch


class TandemWorkerExtension:
    """vLLM mixes this class into each worker; ``self`` is the worker."""

    def tandem_load_weights(self, payload: bytes) -> int:
        """Load a ``torch.save``-d ``{name: tensor}`` dict (HF names) into the running model; returns how many."""
        named = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        # reload_weights (not model.load_weights) restores layers whose weights vLLM repacked for
        # its kernels after the first load (e.g. CPU GEMMs), then processes them again.
        self.model_runner.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
        return len(named)
