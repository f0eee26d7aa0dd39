"""One sequence's images, as a vision-language model's image processor made them: what a rollout
request, a batch row (the ``images`` field) and a packed row carry for a VLM."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.device import to_device

IMAGES_FIELD = "images"  # a batch's per-row ImageInputs (None: a text-only row)


@dataclass(frozen=True)
class ImageInputs:
    """One sequence's images as the model's image processor made them.

    Attributes:
        pixel_values: ``[P, D]`` float: every image's flattened patches, image after image
            (``D = channels * temporal_patch * patch * patch``).
        image_grid_thw: ``[I, 3]`` int64: each image's (time, height, width) patch grid;
            ``P = sum(t * h * w)``.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def token_counts(self, merge_size: int) -> list[int]:
        """How many ``<|image_pad|>`` tokens each image takes in the prompt."""
        return [int(n) for n in (self.image_grid_thw.prod(-1) // merge_size**2).tolist()]

    def to(self, device: torch.device) -> ImageInputs:
        return ImageInputs(to_device(self.pixel_values, device), to_device(self.image_grid_thw, device))

    @functools.cached_property
    def digest(self) -> bytes:
        """A 16-byte blake2b digest of the pixels (dtype, shape, bytes) and grids: equal images,
        equal digests (rows or requests sharing a prompt must share its images too). Computed
        once per object (the n rows or requests of a group hold one) and kept with it."""
        digest = hashlib.blake2b(digest_size=16)
        for tensor in (self.pixel_values, self.image_grid_thw):
            host = tensor.detach().cpu().contiguous()
            digest.update(f"{host.dtype}{tuple(host.shape)}".encode())
            digest.update(host.view(torch.uint8).numpy().tobytes() if host.numel() else b"")
        return digest.digest()

    @staticmethod
    def concat(parts: Sequence[ImageInputs]) -> ImageInputs:
        """Several sequences' images one after another (the order their tokens are packed in)."""
        return ImageInputs(
            torch.cat([part.pixel_values for part in parts]),
            torch.cat([part.image_grid_thw for part in parts]),
        )
