"""maxtext: a YAML-configured JAX framework to pretrain and finetune LLMs."""

__version__ = "0.1.0"
