"""Storing a vision-language draw's images (:mod:`tandem.dataplane.images`): the peak memory and
time of putting one rank's rows into the shared-memory store, the pixels given as the rows' own
tensors (``UnpaddedField``, what ``store_rollout`` does now) against the pixels first written into
the padded ``[B, 1 + P + 1, D]`` tensor the layout bounds (the way before), in the same run.

The draw: ``--groups`` prompts of ``--responses`` rows each, one image of ``--patches`` patches a
prompt (the group's rows share it, so only its first row stores it), stored at the layout of a
``--prompt-width`` token prompt with Qwen2-VL's patches (D = 3 * 2 * 14 * 14 = 1176, merge 2:
P = prompt width * 4). Each way runs in a fresh process; its peak is the resident-set growth of
the put (``ru_maxrss``), the stored bytes are the same.

    python bench/stored_images.py [--groups 16] [--responses 4] [--patches 1024] [--prompt-width 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

PATCH_DIM, MERGE = 1176, 2


def _put(way: str, groups: int, responses: int, patches: int, prompt_width: int) -> dict[str, float]:
    import torch

    from tandem.dataplane import ShmStore
    from tandem.dataplane.images import IMAGE_PIXELS, ImageLayout, image_columns
    from tandem.protocol.images import ImageInputs

    layout = ImageLayout(prompt_width, prompt_width * MERGE * MERGE, PATCH_DIM)
    side = int(patches**0.5)
    images = []
    for group in range(groups):
        pixels = torch.randn(side * side, PATCH_DIM, generator=torch.Generator().manual_seed(group))
        images += [ImageInputs(pixels, torch.tensor([[1, side, side]]))] * responses
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        store = ShmStore(directory)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        began = time.perf_counter()
        stored, _ = image_columns(images, layout)
        if way == "padded":
            stored = {**stored, IMAGE_PIXELS: stored[IMAGE_PIXELS].padded()}
        block = store.put(stored)
        seconds = time.perf_counter() - began
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        stored_bytes = Path(block.path).stat().st_size
        store.release(block)
    return {"seconds": seconds, "peak_mb": peak / 1024, "stored_mb": stored_bytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--patches", type=int, default=1024)
    parser.add_argument("--prompt-width", type=int, default=1024)
    parser.add_argument("--way", choices=["unpadded", "padded"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.groups, args.responses, args.patches, args.prompt_width)
    if args.way:  # one measurement, in this fresh process
        print(json.dumps(_put(args.way, *shape)))
        return
    print(describe_machine())
    rows, bound = args.groups * args.responses, args.prompt_width * MERGE * MERGE
    print(
        f"{rows} rows, {args.groups} images of {args.patches} patches; layout: {bound} patches x {PATCH_DIM}"
    )
    results = {}
    for way in ("unpadded", "padded"):
        command = [sys.executable, __file__, "--way", way, *sys.argv[1:]]
        results[way] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        got = results[way]
        print(
            f"{way:>9}: peak +{got['peak_mb']:.0f} MB, {got['seconds']:.2f} s, stored {got['stored_mb']:.1f} MB"
        )
    new, old = results["unpadded"], results["padded"]
    print(
        f"unpadded / padded: peak {new['peak_mb'] / max(old['peak_mb'], 1):.3f}, "
        f"time {new['seconds'] / old['seconds']:.3f}"
    )


if __name__ == "__main__":
    main()
