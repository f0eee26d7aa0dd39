"""``dataplane.*`` of the RL trainer: the trainers' shared section
(:class:`tandem.run.dataplane.TrainerDataPlaneConfig`, moved there so that SFT and DPO have it
too), under its old names."""

from __future__ import annotations

from tandem.run.dataplane import TrainerDataPlaneConfig, check_dataplane

RLDataPlaneConfig = TrainerDataPlaneConfig

__all__ = ["RLDataPlaneConfig", "check_dataplane"]
