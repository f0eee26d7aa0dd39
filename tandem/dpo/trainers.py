"""``preference_trainer``: the trainer a :class:`~tandem.dpo.DPOConfig` asks for — the DPO
trainer for paired losses, the KTO trainer for unpaired ones."""

from __future__ import annotations

from rich.console import Console

from tandem.dpo.config import DPOConfig
from tandem.dpo.kto_trainer import KTOTrainer
from tandem.dpo.trainer import DPOTrainer


def preference_trainer(config: DPOConfig, console: Console | None = None) -> DPOTrainer:
    """:class:`KTOTrainer` when ``config.preference`` is unpaired, else :class:`DPOTrainer`."""
    trainer = KTOTrainer if config.preference.unpaired else DPOTrainer
    return trainer(config, console)
