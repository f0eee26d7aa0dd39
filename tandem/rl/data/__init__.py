"""RL prompts: verl-schema parquet datasets (with images for vision-language models), built-in synthetic tasks, and converters for local gsm8k/MATH files."""

from tandem.rl.data.arithmetic import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.data.dataset import PromptSample, RLDataset, validate_row
from tandem.rl.data.images import ImageReader, PromptImages, image_reader
from tandem.rl.data.public import gsm8k_rows, math_rows

__all__ = [
    "ArithmeticTaskConfig",
    "ImageReader",
    "PromptImages",
    "PromptSample",
    "RLDataset",
    "arithmetic_rows",
    "gsm8k_rows",
    "image_reader",
    "math_rows",
    "validate_row",
]
