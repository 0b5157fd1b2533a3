"""Does the multimodal model use its images? The eval loss of a trained use_multimodal checkpoint on its eval split,
against the same model and batches with every image replaced by a blank (uniform grey) picture.

    python benchmarks/vlm_grounding.py configs/quickstart_vlm.yml [key=value ...]

Reads the run's latest checkpoint (train it first: python -m maxtext.train configs/quickstart_vlm.yml) and prints
one JSON line: eval_loss with the images, eval_loss with blank images, over eval_steps batches. A model that reads
its images has the first well below the second (the answers are only in the pictures).
"""

from __future__ import annotations

import json
import sys

GREY = 128  # the blank picture's level in every channel


def main(argv: list[str]) -> dict[str, float]:
  import jax
  import numpy as np

  from maxtext import mesh as mesh_lib
  from maxtext.config import load
  from maxtext.data.features import IMAGE_KEY
  from maxtext.train import checkpointing, loop
  from maxtext.train import setup as setup_lib

  config = load(argv)
  if not config.use_multimodal:
    raise SystemExit("error: this compares images with blank ones; give a use_multimodal config (configs/quickstart_vlm.yml)")
  mesh = mesh_lib.create(config)
  setup = setup_lib.build(config, mesh)
  ckpt = checkpointing.Checkpointer(config)
  try:
    with jax.set_mesh(mesh):
      state = loop.restore_or_init(setup, ckpt, None, lambda line: None)
      seen, blank = [], []
      for batch in loop.eval_batches(loop.create_data_iterator(config, mesh, "eval"), config.eval_steps):
        seen.append(setup.eval_on(state, batch))
        grey = jax.device_put(np.full(batch[IMAGE_KEY].shape, GREY, np.uint8), batch[IMAGE_KEY].sharding)  # only image tokens' chunks are read
        blank.append(setup.eval_on(state, {**batch, IMAGE_KEY: grey}))
  finally:
    ckpt.close()
  combine = setup.objective.combine_eval
  return {"eval_loss": combine(jax.device_get(seen))["eval_loss"], "eval_loss_blank_images": combine(jax.device_get(blank))["eval_loss"], "batches": len(seen)}


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1:])))
