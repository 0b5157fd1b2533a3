"""A tiny Qwen3-Next-shaped model (3 Gated DeltaNet layers + 1 gated attention layer, experts, one 64-token chunk of the
delta rule per row) on 8 simulated CPU devices gives the one-device loss and gradients (float32).

It used to hang: the chunked delta rule's CPU LAPACK triangular solve waits on thread-pool work that the other
devices' executions, blocked in the layer scan's collectives, never let run (with 64-token chunks; 8-token ones were small enough to solve without the pool). A watchdog ends the process with every
thread's traceback instead of letting a regression hang the suite.
"""

from __future__ import annotations

import faulthandler

import pytest

from maxtext.config import from_overrides
from tests import test_pipeline as helpers
from tests.test_pipeline_hybrid import TINY_QWEN3_NEXT

MODEL = "qwen3_next_4"
helpers.MODELS[MODEL] = dict(TINY_QWEN3_NEXT, base_num_decoder_layers=4)
WATCHDOG_S = 480  # both programs compile and run in about a minute on 2 cores; a hang ends the process instead


def test_sharded_loss_and_gradients_equal_one_device():
  faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
  try:
    sharded = helpers.config_for(MODEL)  # fsdp over 8 devices
    one = from_overrides(num_devices=1, **{**helpers.SMALL, **helpers.MODELS[MODEL], "per_device_batch_size": sharded.global_batch_size_to_train_on})
    one_loss, one_grads = helpers.loss_and_grads(MODEL, one)
    loss, grads = helpers.loss_and_grads(MODEL, sharded)
  finally:
    faulthandler.cancel_dump_traceback_later()
  assert loss == pytest.approx(one_loss, rel=1e-5)
  assert grads.keys() == one_grads.keys()
  helpers.assert_gradients_close(grads, one_grads)
