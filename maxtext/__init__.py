"""maxtext: a YAML-configured JAX framework to pretrain and finetune LLMs."""

from maxtext.platform import choose_platform as _choose_platform

__version__ = "0.1.0"

# On a host without TPU chips, JAX is kept off the TPU backend before it starts, so an installed libtpu stays
# silent for library use as for the entry points (JAX_PLATFORMS, when set, is left alone; maxtext.platform).
_choose_platform()


def __getattr__(name: str):
  if name == "from_hf":  # imported lazily: `import maxtext` stays light
    from maxtext.hf import from_hf

    return from_hf
  if name == "generate":
    from maxtext.inference.generate import generate

    return generate
  raise AttributeError(f"module 'maxtext' has no attribute {name!r}")
