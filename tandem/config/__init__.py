"""Typed dataclass configs, one per component, with validation that names the bad field."""

from tandem.config.validation import check_choice, check_finite, check_positive, check_range

__all__ = ["check_choice", "check_finite", "check_positive", "check_range"]
