"""LoRA adapters <-> Hugging Face PEFT adapters, and merging adapters into base weights.

A PEFT adapter directory holds adapter_config.json (r, lora_alpha, target_modules) and
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] per adapted linear layer. Our adapters are A [in..., r] and B [r, out...]
beside a kernel [in..., out...] whose Hugging Face weight is kernel.reshape(in, out).T (every
projection rule in maxtext.convert.hf_layer_rules has that layout), so lora_A = A.reshape(in, r).T and
lora_B = B.reshape(r, out).T, and the merged weight W + (alpha / r) B A maps through the same rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from maxtext.config import MaxTextConfig
from maxtext.convert.hf_layer_rules import layer_rules
from maxtext.convert.hf_layer_slots import Slot, slots
from maxtext.errors import ConfigError
from maxtext.layers.lora import merge as merge_kernel
from maxtext.models import registry
from maxtext.models.family import LayerKind
from maxtext.train import outputs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.model.layers"
LORA_A, LORA_B = "lora/lora_a", "lora/lora_b"
MHC_MARK = "_connection/"  # mHC connector parameters live under attention_connection/ and mlp_connection/


def _hf_module_names(config: MaxTextConfig, kind: LayerKind | None = None) -> dict[str, str]:
  """Our module path inside a layer -> the Hugging Face module under model.layers.<i> (dense projections only), of a
  layer of `kind` (None: of every kind the model's layer pattern has)."""
  kinds = [kind] if kind is not None else list(dict.fromkeys(registry.get(config.decoder_block).kinds(config)))
  return {r.ours[: -len("/kernel")]: r.hf[: -len(".weight")] for k in kinds for r in layer_rules(config, k) if not r.experts and r.ours.endswith("/kernel")}


def _adapted(keys: Any, slot: Slot) -> list[str]:
  """Module paths inside the layer at `slot` that carry adapters among keys (flat '/'-paths)."""
  head = slot.prefix + "/"
  return sorted(k[len(head) : -len(LORA_A) - 1] for k in keys if k.startswith(head) and k.endswith(LORA_A) and not k[len(head)].isdigit())


def _value(flat: dict[str, Any], slot: Slot, name: str) -> np.ndarray:
  value = np.asarray(flat[f"{slot.prefix}/{name}"])
  return value if slot.index is None else value[slot.index]


def _shape(shapes: dict[str, tuple[int, ...]], slot: Slot, name: str) -> tuple[int, ...]:
  shape = tuple(shapes[f"{slot.prefix}/{name}"])
  return shape if slot.index is None else shape[1:]


# Families whose Hugging Face model types peft (under transformers 5) reads as fused-expert models: it maps the target
# modules gate_proj/up_proj/down_proj (w1/w2/w3 for Mixtral) onto the stacked routed experts, so an adapter of that
# name on a shared expert or a dense MLP is dropped without an error (peft.utils.transformers_weight_conversion).
PEFT_FUSED_EXPERT_FAMILIES = frozenset({"deepseek", "deepseek_v32", "mixtral", "qwen3_moe", "qwen3_next"})
FUSED_EXPERT_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


def _check_exportable(flat: dict[str, Any], config: MaxTextConfig) -> None:
  if config.mhc_expansion_rate > 1 or any(MHC_MARK in k for k in flat):
    raise ConfigError("mHC connectors have no Hugging Face or PEFT equivalent; export a model trained with mhc_expansion_rate=1")


def _peft_modules(flat: dict[str, Any], config: MaxTextConfig) -> list[tuple[Slot, dict[str, str]]]:
  """Each decoder layer's place (hf_layer_slots.Slot; its hf_index is the PEFT layer index) and its adapted modules ->
  Hugging Face module names; a one-line error for adapters PEFT cannot hold."""
  out = []
  for slot in slots(config):
    names, modules = _hf_module_names(config, slot.kind), _adapted(flat, slot)
    if "mlp/gate" in modules:
      raise ConfigError("adapters on the MoE router (mlp/gate) have no PEFT equivalent; use --merge, or a lora.lora_module_path without mlp/gate")
    unknown = [m for m in modules if m not in names]
    if unknown:
      raise ConfigError(f"adapted module(s) {', '.join(unknown)} have no Hugging Face name; use mlp_activations with two entries (gated MLP)")
    out.append((slot, {m: names[m] for m in modules}))
  if not any(modules for _, modules in out):
    raise ConfigError("the checkpoint holds no LoRA adapters; pass the checkpoint of a run with lora.enable_lora=true")
  return out


def to_peft(flat: dict[str, Any], config: MaxTextConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Our adapters (flat '/'-paths) -> (PEFT tensors, adapter_config.json dict)."""
  _check_exportable(flat, config)
  r = config.lora.lora_rank
  tensors: dict[str, np.ndarray] = {}
  hf_names: set[str] = set()
  for slot, modules in _peft_modules(flat, config):
    for ours, hf in modules.items():
      a = _value(flat, slot, f"{ours}/{LORA_A}")
      b = _value(flat, slot, f"{ours}/{LORA_B}")
      tensors[f"{PEFT_PREFIX}.{slot.hf_index}.{hf}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
      tensors[f"{PEFT_PREFIX}.{slot.hf_index}.{hf}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
      hf_names.add(hf)
  fused = sorted(hf for hf in hf_names if hf.rsplit(".", 1)[-1] in FUSED_EXPERT_NAMES)
  if fused and config.decoder_block in PEFT_FUSED_EXPERT_FAMILIES:
    raise ConfigError(
      f"PEFT reads adapters named {', '.join(sorted({h.rsplit('.', 1)[-1] for h in fused}))} on {config.decoder_block} models as adapters of its "
      f"fused routed experts, so the adapter on {fused[0]} would not load; use --merge, or a lora.lora_module_path on the attention projections only"
    )
  alpha = config.lora.lora_alpha
  adapter_config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": r,
    "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
    "target_modules": sorted({hf.rsplit(".", 1)[-1] for hf in hf_names}),
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "inference_mode": True,
  }
  return tensors, adapter_config


def lora_overrides(adapter_config: dict[str, Any], config: MaxTextConfig) -> dict[str, Any]:
  """The lora.* config keys that reproduce a PEFT adapter: rank, alpha and a module regex from target_modules."""
  if adapter_config.get("peft_type", "LORA") != "LORA" or adapter_config.get("use_rslora") or adapter_config.get("use_dora"):
    raise ConfigError("only plain LoRA PEFT adapters load (peft_type LORA, no rsLoRA or DoRA); re-export the adapter without them")
  if adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern") or adapter_config.get("layers_to_transform"):
    raise ConfigError("PEFT adapters with rank_pattern, alpha_pattern or layers_to_transform do not load; every layer needs the same rank")
  targets = adapter_config.get("target_modules") or []
  targets = [targets] if isinstance(targets, str) else list(targets)
  ours = sorted(m for m, hf in _hf_module_names(config).items() if hf.rsplit(".", 1)[-1] in targets)
  if not ours:
    raise ConfigError(f"target_modules {targets} name no projection of the {config.decoder_block} model; check the adapter belongs to this model")
  return {
    "enable_lora": True,
    "lora_rank": int(adapter_config["r"]),
    "lora_alpha": float(adapter_config["lora_alpha"]),
    "lora_module_path": "(^|/)(" + "|".join(ours) + ")$",
  }


def from_peft(tensors: dict[str, np.ndarray], config: MaxTextConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
  """PEFT tensors -> our adapters, for `shapes` (adapter path -> shape, of config's model).

  Every adapter of the model must be in tensors and every tensor must be used (else a one-line ConfigError).
  """
  r = config.lora.lora_rank
  used: set[str] = set()

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise ConfigError(f"PEFT adapter lacks '{name}' that this model's lora settings need; check target_modules and the model")
    used.add(name)
    value = np.asarray(tensors[name], np.float32)
    if value.shape != shape:
      raise ConfigError(f"PEFT tensor '{name}' has shape {value.shape}, this model needs {shape}; check r and the model dimensions")
    return value

  per_layer: dict[str, list[np.ndarray]] = {}  # stacked path -> its layers' values, in stack order
  out: dict[str, np.ndarray] = {}
  for slot, modules in _peft_modules(shapes, config):
    for ours, hf in modules.items():
      a_shape, b_shape = (_shape(shapes, slot, f"{ours}/{name}") for name in (LORA_A, LORA_B))
      a = take(f"{PEFT_PREFIX}.{slot.hf_index}.{hf}.lora_A.weight", (r, math.prod(a_shape) // r)).T.reshape(a_shape)
      b = take(f"{PEFT_PREFIX}.{slot.hf_index}.{hf}.lora_B.weight", (math.prod(b_shape) // r, r)).T.reshape(b_shape)
      for name, value in ((f"{ours}/{LORA_A}", a), (f"{ours}/{LORA_B}", b)):
        if slot.index is None:
          out[f"{slot.prefix}/{name}"] = value
        else:
          per_layer.setdefault(f"{slot.prefix}/{name}", []).append(value)
  out.update({k: np.stack(v) for k, v in per_layer.items()})
  unused = sorted(set(tensors) - used)
  if unused:
    raise ConfigError(f"PEFT adapter has {len(unused)} tensor(s) this model's adapters do not use, e.g. {unused[0]}; check target_modules")
  return out


def merge(flat: dict[str, Any], config: MaxTextConfig) -> dict[str, np.ndarray]:
  """Base parameters with every adapter merged into its kernel (W + (alpha / r) B A); the adapters are dropped."""
  _check_exportable(flat, config)
  scale = config.lora.lora_alpha / config.lora.lora_rank
  out = {k: np.asarray(v) for k, v in flat.items() if not k.endswith((LORA_A, LORA_B))}
  for key in flat:
    if key.endswith(LORA_A):
      module = key[: -len(LORA_A) - 1]
      kernel = f"{module}/kernel"
      if kernel not in out:
        raise ConfigError(f"adapter '{key}' has no base kernel '{kernel}' to merge into; pass the base parameters too")
      a, b = np.asarray(flat[key]), np.asarray(flat[f"{module}/{LORA_B}"])
      lead = a.ndim + b.ndim - out[kernel].ndim - 2  # stacked layer axes: A [L.., in.., r], B [L.., r, out..], kernel [L.., in.., out..]
      out[kernel] = np.asarray(merge_kernel(out[kernel], a, b, scale, lead=lead))
  return out


def write(out_dir: str | Path, tensors: dict[str, np.ndarray], adapter_config: dict[str, Any]) -> None:
  from safetensors.numpy import save_file

  d = Path(out_dir)
  d.mkdir(parents=True, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
  (d / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")


def read(peft_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """(tensors, adapter_config) of a PEFT adapter directory."""
  from maxtext.convert.safetensors_io import _load, read_json_object

  d = Path(peft_dir)
  cfg, weights = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
  if not cfg.is_file() or not weights.is_file():
    raise ConfigError(f"'{d}' is not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
  adapter_config = read_json_object(cfg, "fix or re-export the adapter")
  for key in ("r", "lora_alpha"):
    if key not in adapter_config:
      raise ConfigError(f"'{cfg}' has no '{key}'; is this a LoRA adapter?")
  return _load(weights), adapter_config


def _abstract_params(config: MaxTextConfig, policy: Any = None, mesh: Any = None) -> Any:
  """The config's parameters (of the model `policy` builds; default: the local platform's) as ShapeDtypeStructs sharded
  over mesh (default: the config's mesh over jax.devices()) (an nnx.State), for restoring."""
  import jax
  from flax import nnx

  from maxtext import mesh as mesh_lib
  from maxtext import models

  abstract = nnx.state(models.abstract_model(config, policy), nnx.Param)
  shardings = models.state_shardings(abstract, config, mesh_lib.create(config) if mesh is None else mesh)
  return jax.tree.map(
    lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )


def _flat_numpy(state: Any) -> dict[str, np.ndarray]:
  import jax

  from maxtext.convert.model_params import flat_params

  return {k: np.asarray(jax.device_get(v)) for k, v in flat_params(state).items()}


def export(checkpoint: str, out: str, config_args: list[str], merged: bool = False, adapter: str = "") -> str:
  """A LoRA run's checkpoint -> a PEFT adapter directory, or with merged=True a full Hugging Face model directory
  (base from the config's load_parameters_path, W + (alpha / r) B A). Returns a one-line summary.

  With lora.max_lora_adapters > 1, `adapter` names the one slot to export (at its own rank)."""
  from flax import nnx

  from maxtext.config import load
  from maxtext.convert import hf_params, safetensors_io
  from maxtext.convert.hf_config_export import hf_config_from
  from maxtext.layers.lora import LoRAParam
  from maxtext.train.checkpoint_files import restore_some_params

  config = load(config_args + ["ici_fsdp_parallelism=-1"], env={})
  if not config.lora.enable_lora:
    raise ConfigError("pass the LoRA run's config (with lora.enable_lora=true and its lora.* settings) after --config")
  _check_exportable({}, config)
  out_path = Path(out)
  outputs.check_new_directory(out, "--out")
  abstract = _abstract_params(config)
  adapters, _ = restore_some_params(checkpoint, nnx.filter_state(abstract, LoRAParam), "--checkpoint")
  flat = _flat_numpy(adapters)
  if config.lora.max_lora_adapters > 1:
    from maxtext.config.adapters import single_adapter_config
    from maxtext.convert.checkpoint_io import slot_params

    if not adapter:
      raise ConfigError("this run has several adapters; name the one to export with --adapter <name> (see lora.lora_adapters)")
    flat = {k: np.asarray(v) for k, v in slot_params(flat, config, adapter).items()}
    config = single_adapter_config(config, adapter)
  elif adapter:
    raise ConfigError("--adapter applies to runs with lora.max_lora_adapters > 1; drop it")
  if not merged:
    tensors, adapter_config = to_peft(flat, config)
    write(out_path, tensors, adapter_config)
    return f"wrote {out_path} (PEFT adapter: r={adapter_config['r']}, target_modules={adapter_config['target_modules']})"
  if not config.load_parameters_path:
    raise ConfigError("--merge needs the base weights: add load_parameters_path=<the hf-to-maxtext output> to --config")
  from maxtext.convert import hf_dir

  base_target = nnx.filter_state(abstract, nnx.Not(LoRAParam))
  if hf_dir.is_hf_dir(config.load_parameters_path):
    base = hf_dir.restore(config.load_parameters_path, config, base_target)
  else:
    base, _ = restore_some_params(config.load_parameters_path, base_target, "load_parameters_path")
  safetensors_io.write(out_path, hf_config_from(config), hf_params.maxtext_to_hf(merge({**_flat_numpy(base), **flat}, config), config))
  copied = hf_dir.copy_extras(hf_dir.source_dir(config), out_path)
  return f"wrote {out_path} (config.json + model.safetensors with the adapters merged{', ' + ', '.join(copied) if copied else ''})"


def import_adapter(peft_dir: str, out: str, config_args: list[str]) -> str:
  """A PEFT adapter directory -> an adapters-only checkpoint for lora.lora_restore_path. Returns the keys to train with."""
  import jax.numpy as jnp
  from flax import nnx

  from maxtext.config import load
  from maxtext.layers.lora import LoRAParam
  from maxtext.train.checkpoint_files import save_params

  given = [a for a in config_args if a.startswith("lora.")]
  if given:
    raise ConfigError(f"peft-to-lora takes the lora settings from {ADAPTER_CONFIG}; drop {given[0].split('=')[0]} from --config")
  out_path = Path(out)
  outputs.check_new_directory(out, "--out")
  tensors, adapter_config = read(peft_dir)
  base_config = load(config_args + ["ici_fsdp_parallelism=-1"], env={})
  keys = lora_overrides(adapter_config, base_config)
  lora_args = [f"lora.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
  config = load(config_args + ["ici_fsdp_parallelism=-1"] + lora_args, env={})
  abstract = nnx.filter_state(_abstract_params(config), LoRAParam)
  shapes = {"/".join(map(str, p)): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(abstract)}
  flat = from_peft(tensors, config, shapes)
  leaves = [(p, v.replace(jnp.asarray(flat["/".join(map(str, p))], v.get_value().dtype))) for p, v in nnx.to_flat_state(abstract)]
  save_params(str(out_path.absolute()), nnx.from_flat_state(leaves))
  return " ".join(lora_args[:-1] + [f"'{lora_args[-1]}'", f"lora.lora_restore_path={out_path.absolute()}"])
