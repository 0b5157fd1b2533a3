"""The initial parameters of a run: load_parameters_path over the fresh init (float kernels quantized on load, or
a save_quantized_params_path checkpoint as it is), then the LoRA adapters of lora.lora_restore_path."""

from __future__ import annotations

from typing import Any

import jax

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.models import pipeline, pipeline_specs
from maxtext.train.checkpoint_files import ITEM, item_path, overlay_params, read_metadata_tree, restore_some_params


def stored_kernels(abstract_params: Any) -> dict[tuple, tuple[Any, tuple, Any]]:
  """Kernels held quantized (QLoRA base, decoding): kernel path -> (kernel Variable, its scales' path, KernelScale Variable)."""
  from flax import nnx

  from maxtext.layers.quantization import KernelScale, kernel_path

  flat = dict(nnx.to_flat_state(abstract_params))
  return {kernel_path(keys): (flat[kernel_path(keys)], keys, var) for keys, var in flat.items() if isinstance(var, KernelScale)}


def base_target(config: MaxTextConfig, abstract_params: Any) -> Any:
  """abstract_params as load_parameters_path holds them: stored kernels in weight_dtype without scales (a float
  checkpoint, quantized on load), or as they are with checkpoint_is_quantized."""
  import jax.numpy as jnp
  from flax import nnx

  from maxtext.layers.quantization import recipe, unpacked_shape

  stored = stored_kernels(abstract_params)
  if config.checkpoint_is_quantized or not stored:
    return abstract_params
  scales = {scale_path for _, scale_path, _ in stored.values()}
  weight = recipe(config).weight
  leaves = []
  for keys, var in nnx.to_flat_state(abstract_params):
    if keys in stored:
      value = var.get_value()
      shape = unpacked_shape(value.shape, stored[keys][2], weight)
      var = var.replace(jax.ShapeDtypeStruct(shape, jnp.dtype(config.weight_dtype), sharding=getattr(value, "sharding", None)))
    if keys not in scales:
      leaves.append((keys, var))
  return nnx.from_flat_state(leaves)


def check_base_quantization(config: MaxTextConfig, path: str, abstract_params: Any) -> None:
  """load_parameters_path's kernels must be quantized exactly when checkpoint_is_quantized says so, in the model's format."""
  from maxtext.layers.quantization import SCALE_SUFFIX, kernel_path

  stored = stored_kernels(abstract_params)
  tree = read_metadata_tree(item_path(path)).get("params", {})
  saved = {}
  for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)
    saved[names[:-1] if names and names[-1] == "value" else names] = leaf

  def quantized(keys: tuple) -> bool:  # a '<kernel>_scale' beside a one-byte (int8, int4, fp8) kernel
    kernel = saved.get(kernel_path(keys))
    return keys[-1].endswith(SCALE_SUFFIX) and kernel is not None and jax.numpy.dtype(getattr(kernel, "dtype", "float32")).itemsize == 1

  has_scales = any(quantized(k) for k in saved)
  if config.checkpoint_is_quantized and not has_scales:
    raise ConfigError(
      f"load_parameters_path '{path}' holds float kernels (no kernel_scale), not quantized ones; drop checkpoint_is_quantized to quantize them on load"
    )
  if has_scales and not config.checkpoint_is_quantized:
    raise ConfigError(f"load_parameters_path '{path}' holds quantized kernels (save_quantized_params_path output); set checkpoint_is_quantized=true")
  if has_scales and not stored:
    raise ConfigError(
      f"load_parameters_path '{path}' holds quantized kernels, which this run keeps in float: load them for LoRA (QLoRA) or decoding, or load the float checkpoint"
    )
  for keys, (kernel, _, _) in stored.items():
    leaf = saved.get(tuple(str(k) for k in keys))
    want = kernel.get_value().dtype
    have = getattr(leaf, "dtype", None)
    if config.checkpoint_is_quantized and have is not None and jax.numpy.dtype(have) != want:
      raise ConfigError(
        f"load_parameters_path '{path}' holds {'/'.join(map(str, keys))} as {_format(jax.numpy.dtype(have))}, quantization={config.quantization} stores {_format(want)}; "
        "pass the quantization it was saved with"
      )


def _format(dtype: Any) -> str:
  """A stored kernel's dtype as its quantized format (int4 is packed two per byte in uint8)."""
  return "int4 (two per uint8)" if dtype == jax.numpy.uint8 else dtype.name


def quantize_restored(config: MaxTextConfig, restored: Any, abstract_params: Any) -> Any:
  """restored with every float kernel that the model stores quantized replaced by its values and scales (one jitted
  function, its outputs born in the abstract kernels' and scales' shardings)."""
  from flax import nnx

  from maxtext.layers import quantization

  stored = stored_kernels(abstract_params)
  flat = dict(nnx.to_flat_state(restored))
  todo = [keys for keys in stored if keys in flat]
  if config.checkpoint_is_quantized or not todo:
    return restored
  recipe = quantization.recipe(config)
  scale_vars = [stored[keys][2] for keys in todo]

  def quantize(kernels):
    return [quantization.quantize_like(w, scale, recipe) for w, scale in zip(kernels, scale_vars)]

  shardings = [tuple(getattr(stored[keys][i].get_value(), "sharding", None) for i in (0, 2)) for keys in todo]
  fn = jax.jit(quantize, out_shardings=shardings if all(s[0] is not None for s in shardings) else None)
  for keys, (values, scales) in zip(todo, fn([flat[keys].get_value() for keys in todo])):
    kernel, scale_path, scale = stored[keys]
    flat[keys] = kernel.replace(values)
    flat[scale_path] = scale.replace(scales)
  return nnx.from_flat_state(flat)


def _loaded_from(path: str) -> str:
  """The checkpoint directory load_parameters_path stood for: the step of a checkpoints/ directory, else the path as given."""
  item = item_path(path)
  return str(item.parent) if item.name == ITEM else str(item)


def load_initial_params(config: MaxTextConfig, params: Any, abstract_params: Any, log: Any, adapters: bool = True) -> Any:
  """Freshly initialised params overlaid with load_parameters_path, then (adapters=True) lora.lora_restore_path.

  A base checkpoint may lack LoRA adapters and mHC connectors: they keep their init (identity at step 0).
  lora.lora_restore_path restores the adapters (and connectors it holds) of an earlier LoRA run or of
  `python -m maxtext.convert peft-to-lora`.
  """
  from flax import nnx

  from maxtext.layers.lora import LoRAParam
  from maxtext.layers.mhc import MHCParam

  abstract_params = pipeline.to_storage(abstract_params, pipeline_specs.pipeline(config))  # as checkpoints hold the layers: one stack, plain order
  if config.lora.enable_lora and not config.load_parameters_path:
    log(
      f"warning: lora.enable_lora=true without load_parameters_path: the frozen base is a random init (init_weights_seed={config.init_weights_seed}), "
      "not a trained model; set load_parameters_path=<base checkpoint> to train the adapters over one"
    )
  if config.load_parameters_path:
    from maxtext.convert import hf_dir

    path = config.load_parameters_path
    if hf_dir.is_hf_dir(path):  # config.json + safetensors, converted and sharded while read
      added = nnx.Any(LoRAParam, MHCParam)
      target = base_target(config, abstract_params)
      restored = hf_dir.restore(path, config, nnx.filter_state(target, nnx.Not(added)))
      lacking = list(nnx.to_flat_state(nnx.filter_state(target, added)))
      where = path
    else:
      check_base_quantization(config, path, abstract_params)
      restored, lacking = restore_some_params(path, base_target(config, abstract_params), "load_parameters_path", may_lack=nnx.Any(LoRAParam, MHCParam))
      where = _loaded_from(path)
    params = overlay_params(params, pipeline.from_storage(quantize_restored(config, restored, abstract_params), pipeline_specs.pipeline(config)))
    note = f" ({len(lacking)} adapter/connector arrays it lacks keep their init)" if lacking else ""
    stored = stored_kernels(abstract_params)
    how = (
      "" if not stored else " (quantized kernels)" if config.checkpoint_is_quantized else f" ({len(stored)} kernels quantized to {config.quantization} on load)"
    )
    log(f"loaded parameters from {where}{how}{note}")
  if adapters and config.lora.lora_restore_path:
    if not config.lora.enable_lora:
      raise ConfigError(f"lora.lora_restore_path='{config.lora.lora_restore_path}' needs lora.enable_lora=true")
    wanted = nnx.filter_state(abstract_params, nnx.Any(LoRAParam, MHCParam))
    restored, _ = restore_some_params(config.lora.lora_restore_path, wanted, "lora.lora_restore_path", may_lack=MHCParam)
    params = overlay_params(params, pipeline.from_storage(restored, pipeline_specs.pipeline(config)))
    log(f"loaded LoRA adapters from {config.lora.lora_restore_path}")
  return params
