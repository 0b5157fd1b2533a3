"""The embedded image-text set (dataset_type=embedded with use_multimodal): small generated pictures of one coloured
shape, with questions whose answers only the picture holds.

Each record is {'prompt': '<image place> <question>', 'completion': ' <answer>', 'image': PNG bytes}: a shape
(circle, square, triangle, cross) of a colour (red, green, blue, yellow) at a random place and size on a grey
background, asked for its colour or its shape (the question never names either). The records are the same on
every run (seeded by index); every EVAL_EVERY-th is held out as the eval split.
"""

from __future__ import annotations

import io

import grain
import numpy as np
from PIL import Image, ImageDraw

from maxtext.data.sources import Source

SIZE = 48  # pixels per side of the generated pictures (the processor resizes them to image_size_for_vit)
RECORDS = 1200
EVAL_EVERY = 10
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle", "cross")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "Which shape is in the picture?"}


def picture(shape: str, colour: tuple[int, int, int], rng: np.random.Generator) -> bytes:
  """PNG bytes of one shape on a grey background."""
  image = Image.new("RGB", (SIZE, SIZE), (128, 128, 128))
  draw = ImageDraw.Draw(image)
  r = int(rng.integers(SIZE // 5, SIZE // 3))
  cx, cy = (int(v) for v in rng.integers(r, SIZE - r, size=2))
  box = (cx - r, cy - r, cx + r, cy + r)
  if shape == "circle":
    draw.ellipse(box, fill=colour)
  elif shape == "square":
    draw.rectangle(box, fill=colour)
  elif shape == "triangle":
    draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
  else:
    w = max(2, r // 3)
    draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
    draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
  out = io.BytesIO()
  image.save(out, format="PNG")
  return out.getvalue()


def record(index: int, placeholder: str) -> dict[str, object]:
  rng = np.random.default_rng(index)
  colour, shape = list(COLOURS)[int(rng.integers(len(COLOURS)))], SHAPES[int(rng.integers(len(SHAPES)))]
  asked = ("colour", "shape")[int(rng.integers(2))]  # drawn, not by index: the held-out split (every 10th) asks both
  answer = colour if asked == "colour" else shape
  return {"prompt": f"{placeholder}\n{QUESTIONS[asked]}", "completion": f" {answer}.", "image": picture(shape, COLOURS[colour], rng)}


def documents(split: str, placeholder: str) -> list[tuple[str, dict[str, object]]]:
  """(where, record) of each picture in the split."""
  held_out = split != "train"
  return [(f"embedded shapes record {i}", record(i, placeholder)) for i in range(RECORDS) if (i % EVAL_EVERY == 0) == held_out]


def source(split: str, placeholder: str) -> Source:
  return Source(grain.MapDataset.source(documents(split, placeholder)), f"embedded shapes pictures ({split})")


def texts() -> list[str]:
  """Text of the set for a tokenizer to learn (the questions and answers)."""
  return [*QUESTIONS.values(), *(f" {w}." for w in (*COLOURS, *SHAPES))]
