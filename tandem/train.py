"""``python -m tandem.train key=value ...``: RL training (the same as ``tandem train``)."""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
