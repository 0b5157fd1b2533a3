"""maxtext: a YAML-configured JAX framework to pretrain and finetune LLMs."""

__version__ = "0.1.0"


def __getattr__(name: str):
  if name == "from_hf":  # imported lazily: `import maxtext` stays light
    from maxtext.hf import from_hf

    return from_hf
  if name == "generate":
    from maxtext.inference.generate import generate

    return generate
  raise AttributeError(f"module 'maxtext' has no attribute {name!r}")
