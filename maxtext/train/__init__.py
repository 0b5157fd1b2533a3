"""Training: the pure train step, optimizers, schedules, loss, checkpointing and the loop.

`python -m maxtext.train <config.yml> key=value ...` runs `maxtext.train.loop.train`.
AOT compilation uses `maxtext.train.setup.build(config, mesh)`.
"""
