"""Bridges to other projects' tools: lm_eval_backend is maxtext as an lm-evaluation-harness model (`--model maxtext`)."""
