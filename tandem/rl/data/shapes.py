"""The ``shapes`` task: generated pictures of coloured shapes, with questions only the picture answers.

Each scene puts 1 to 4 shapes (circle, square, triangle; red, green, blue, yellow) on a dark
square canvas, one shape per quadrant, centred in it, so shapes never overlap and each covers
whole 28-pixel blocks of a 112-pixel canvas (a tiny Qwen2-VL sees it as 4x4 image tokens). A
question is one of the chosen kinds (default: all four), drawn uniformly, and the scene is built
for an answer drawn uniformly among that kind's answers (the chance levels are :data:`CHANCE`):

* ``count``: "How many red shapes are there?": ``0`` to ``3``;
* ``largest``: "What colour is the largest shape?": a colour; the largest shape is
  :data:`LARGE` of its quadrant, every other shape :data:`SMALL`;
* ``has_circle``: "Is there a circle?": ``yes`` / ``no``; 1 to 4 shapes of any size, a circle
  among them or none;
* ``left_of``: "Is the circle left of the square?": ``yes`` / ``no``; the scene holds the
  circle and the square alone, both large, in different columns. It needs the model to read
  where a token sits in the picture (M-RoPE), which a tiny model trained from scratch does not
  learn in the demo's budget (docs/multimodal.md), so the demo leaves it out.

The ground truth is always recomputed from the scene (:func:`answer`), never taken from the
draw. Rows follow verl's multimodal schema: the PNG in ``images`` as ``{"bytes": ...}`` and the
prompt one user message, ``<image>`` then the question.
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from PIL import Image, ImageDraw

KINDS = ("circle", "square", "triangle")
COLOURS = {"red": (230, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 240), "yellow": (240, 220, 40)}
BACKGROUND = (25, 25, 25)
QUESTIONS = {
    "count": "How many red shapes are there?",
    "largest": "What colour is the largest shape?",
    "has_circle": "Is there a circle?",
    "left_of": "Is the circle left of the square?",
}
ANSWERS = {
    "count": ("0", "1", "2", "3"),
    "largest": tuple(COLOURS),
    "has_circle": ("yes", "no"),
    "left_of": ("yes", "no"),
}
INSTRUCTION = "Answer with one word."
SMALL, MEDIUM, LARGE = 0.5, 0.7, 0.9  # a shape's side as a fraction of its quadrant's
CHANCE = {  # a question kind's accuracy when guessing uniformly, and always giving its commonest answer
    kind: {"uniform_guess": 1 / len(answers), "majority": 1 / len(answers)}
    for kind, answers in ANSWERS.items()
}
DATA_SOURCE = "shapes"


@dataclass(frozen=True)
class Shape:
    """One shape: its kind, colour, centre (pixels) and side (pixels; a circle's diameter)."""

    kind: str
    colour: str
    x: int
    y: int
    size: int


@dataclass(frozen=True)
class Scene:
    """A picture's description: the canvas side in pixels and its shapes."""

    canvas: int
    shapes: tuple[Shape, ...]


def answer(scene: Scene, kind: str) -> str:
    """The answer to question ``kind`` about ``scene``, read off its description."""
    if kind == "count":
        return str(sum(shape.colour == "red" for shape in scene.shapes))
    if kind == "largest":
        largest = max(scene.shapes, key=lambda shape: shape.size)
        if sum(shape.size == largest.size for shape in scene.shapes) != 1:
            raise ValueError("the largest shape is not unique")
        return largest.colour
    if kind == "has_circle":
        return "yes" if any(shape.kind == "circle" for shape in scene.shapes) else "no"
    if kind == "left_of":
        (circle,) = [shape for shape in scene.shapes if shape.kind == "circle"]
        (square,) = [shape for shape in scene.shapes if shape.kind == "square"]
        return "yes" if circle.x < square.x else "no"
    raise ValueError(f"question kind {kind!r} is not one of {list(QUESTIONS)}")


def make_scene(kind: str, target: str, canvas: int, rng: random.Random) -> Scene:
    """A random scene whose answer to question ``kind`` is ``target``."""
    cell = canvas // 2
    quadrants = [(column, row) for row in range(2) for column in range(2)]
    rng.shuffle(quadrants)
    if kind == "count":
        reds = int(target)
        count = rng.randint(max(reds, 1), 4)
        colours = ["red"] * reds + [rng.choice(["green", "blue", "yellow"]) for _ in range(count - reds)]
        kinds = [rng.choice(KINDS) for _ in range(count)]
        sizes = [rng.choice((SMALL, MEDIUM, LARGE)) for _ in range(count)]
    elif kind == "largest":
        count = rng.randint(1, 4)
        colours = [target] + [rng.choice(list(COLOURS)) for _ in range(count - 1)]
        kinds = [rng.choice(KINDS) for _ in range(count)]
        sizes = [LARGE] + [SMALL] * (count - 1)
    elif kind == "has_circle":
        count = rng.randint(1, 4)
        kinds = [rng.choice(("square", "triangle")) for _ in range(count)]
        if target == "yes":
            kinds[0] = "circle"
            kinds = [rng.choice(KINDS) if i else k for i, k in enumerate(kinds)]
        colours = [rng.choice(list(COLOURS)) for _ in range(count)]
        sizes = [rng.choice((SMALL, MEDIUM, LARGE)) for _ in range(count)]
    elif kind == "left_of":
        count = 2  # the circle and the square alone, both large
        left, right = (
            [q for q in quadrants if q[0] == 0][0],
            [q for q in quadrants if q[0] == 1][0],
        )
        circle, square = (left, right) if target == "yes" else (right, left)
        quadrants = [circle, square] + [q for q in quadrants if q not in (circle, square)]
        kinds = ["circle", "square"]
        colours = [rng.choice(list(COLOURS)) for _ in range(count)]
        sizes = [LARGE, LARGE]
    else:
        raise ValueError(f"question kind {kind!r} is not one of {list(QUESTIONS)}")
    order = list(range(count))
    rng.shuffle(order)  # the target shape need not be the first drawn
    shapes = tuple(
        Shape(
            kinds[i],
            colours[i],
            quadrants[i][0] * cell + cell // 2,
            quadrants[i][1] * cell + cell // 2,
            round(sizes[i] * cell),
        )
        for i in order
    )
    return Scene(canvas, shapes)


def draw(scene: Scene):
    """``scene`` as an RGB Pillow image."""
    image = Image.new("RGB", (scene.canvas, scene.canvas), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for shape in scene.shapes:
        half = shape.size / 2
        box = (shape.x - half, shape.y - half, shape.x + half, shape.y + half)
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            pen.ellipse(box, fill=fill)
        elif shape.kind == "square":
            pen.rectangle(box, fill=fill)
        else:  # a triangle pointing up, its base the box's bottom
            pen.polygon([(shape.x, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
    return image


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def shapes_rows(
    count: int,
    seed: int,
    canvas: int = 112,
    split: str = "train",
    questions: Sequence[str] = tuple(QUESTIONS),
) -> list[dict[str, Any]]:
    """``count`` rows of the shapes task in verl's multimodal schema, deterministic in ``seed``, with
    question kinds drawn uniformly from ``questions``; ``extra_info`` holds the question kind and
    the scene (``extra_info["scene"]``)."""
    unknown = [kind for kind in questions if kind not in QUESTIONS]
    if unknown or not questions:
        raise ValueError(f"shapes: questions must be some of {list(QUESTIONS)}, got {list(questions)}")
    if count <= 0:
        raise ValueError(f"shapes: the number of rows must be positive, got {count}")
    if canvas < 56 or canvas % 2:
        raise ValueError(f"shapes: the canvas side must be an even number of pixels >= 56, got {canvas}")
    rng = random.Random(f"shapes-{seed}-{split}")
    rows = []
    for index in range(count):
        kind = rng.choice(list(questions))
        scene = make_scene(kind, rng.choice(ANSWERS[kind]), canvas, rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"<image>{QUESTIONS[kind]} {INSTRUCTION}"}],
                "images": [{"bytes": png_bytes(draw(scene)), "path": None}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": answer(scene, kind)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question": kind,
                    "scene": [asdict(shape) for shape in scene.shapes],
                },
            }
        )
    return rows
