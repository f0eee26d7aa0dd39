"""``python -m tandem.verl.main_ppo KEY=VALUE ...``: verl's ``python -m verl.trainer.main_ppo`` on tandem.

The same as ``tandem train --verl KEY=VALUE ...``; ``--print-config`` shows the tandem config
the command becomes without training.
"""

from __future__ import annotations

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "--verl", *sys.argv[1:]]))
