"""``python -m tandem.sft key=value ...``: run supervised fine-tuning."""

import sys

from tandem.cli import main

sys.exit(main(["sft", *sys.argv[1:]]))
