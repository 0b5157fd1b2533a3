"""Convert checkpoints between Hugging Face and maxtext.

python -m maxtext.convert hf-to-maxtext --hf-dir D --out O [key=value ...]
python -m maxtext.convert maxtext-to-hf --checkpoint O --out D [--config configs/base.yml key=value ...]
python -m maxtext.convert lora-to-peft --checkpoint C --out D [--merge] [--adapter NAME] --config <run config> key=value ...
python -m maxtext.convert peft-to-lora --peft-dir P --out O --config <base model config> key=value ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from maxtext.cli import entry
from maxtext.errors import ConfigError
from maxtext.train import outputs

MODEL_YML = "maxtext_model.yml"
BASE_YML = Path(__file__).resolve().parents[2] / "configs" / "base.yml"


def hf_to_maxtext(hf_dir: str, out: str, overrides: list[str]) -> None:
  from maxtext.config.overrides import parse_cli_value
  from maxtext.convert import checkpoint_io
  from maxtext.convert.hf_config import read_overrides
  from maxtext.hf import from_hf

  out_path = Path(out)
  outputs.check_new_directory(out, "--out")  # before anything is written: a checkpoint writer that fails midway can hang
  extra = {k: parse_cli_value(v) for k, v in (_split(a) for a in overrides)}
  model, config = from_hf(hf_dir, **extra)
  checkpoint_io.save(out_path, model)
  keys = {**read_overrides(hf_dir), **extra}
  keys.pop("dtype", None)
  from maxtext.convert.hf_dir import TOKENIZER_FILES

  if "tokenizer_path" not in keys and any((Path(hf_dir) / f).is_file() for f in TOKENIZER_FILES):  # the directory's tokenizer
    keys.update(tokenizer_type="huggingface", tokenizer_path=str(Path(hf_dir).absolute()))
  model_yml = {"base_config": str(BASE_YML), **keys, "load_parameters_path": str(out_path.absolute())}
  (out_path / MODEL_YML).write_text(yaml.safe_dump(model_yml, sort_keys=False))
  print(f"wrote {out_path} ({config.decoder_block}, {config.num_decoder_layers} layers)")
  print(f"train from it: python -m maxtext.train {out_path / MODEL_YML} run_name=<name> ...")


def maxtext_to_hf(checkpoint: str, out: str, config_args: list[str]) -> None:
  from maxtext.config import load
  from maxtext.convert import checkpoint_io, hf_params, safetensors_io
  from maxtext.convert.hf_config_export import hf_config_from

  ckpt = Path(checkpoint)
  if not config_args:
    if not (ckpt / MODEL_YML).is_file():
      raise ConfigError(f"no {MODEL_YML} in '{ckpt}'; pass --config configs/base.yml model_name=... (the config the checkpoint was trained with)")
    config_args = [str(ckpt / MODEL_YML)]
  out_path = Path(out)
  outputs.check_new_directory(out, "--out")  # before anything is written: a checkpoint writer that fails midway can hang
  config = load(config_args + ["load_parameters_path=", "ici_fsdp_parallelism=-1"], env={})
  flat = checkpoint_io.load_flat(ckpt, config)
  safetensors_io.write(out_path, hf_config_from(config), hf_params.maxtext_to_hf(flat, config))
  print(f"wrote {out_path} (config.json + model.safetensors)")


def _split(arg: str) -> tuple[str, str]:
  if "=" not in arg:
    raise ConfigError(f"argument '{arg}' is not key=value; write e.g. scan_layers=false")
  return tuple(arg.split("=", 1))  # type: ignore[return-value]


@entry(None)
def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m maxtext.convert",
    description=__doc__,
    epilog="example:\n  python -m maxtext.convert hf-to-maxtext --hf-dir ./Qwen3-0.6B --out ./qwen3-0.6b-maxtext\n"
    "  python -m maxtext.train ./qwen3-0.6b-maxtext/maxtext_model.yml run_name=finetune steps=100",
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest="command", required=True)
  a = sub.add_parser("hf-to-maxtext", help="Hugging Face directory -> Orbax params checkpoint")
  a.add_argument("--hf-dir", required=True)
  a.add_argument("--out", required=True)
  a.add_argument("overrides", nargs="*", help="config key=value overrides (e.g. scan_layers=false)")
  b = sub.add_parser("maxtext-to-hf", help="Orbax params (or full-state) checkpoint -> Hugging Face directory")
  b.add_argument("--checkpoint", required=True)
  b.add_argument("--out", required=True)
  b.add_argument("--config", nargs="+", default=[], help="config file and key=value the checkpoint was trained with")
  c = sub.add_parser("lora-to-peft", help="LoRA run checkpoint -> Hugging Face PEFT adapter (or, with --merge, merged HF weights)")
  c.add_argument("--checkpoint", required=True, help="checkpoint step directory of the LoRA run")
  c.add_argument("--out", required=True)
  c.add_argument("--merge", action="store_true", help="write full HF weights W + (alpha/r) B A (base from load_parameters_path)")
  c.add_argument("--config", nargs="+", required=True, help="config file and key=value of the LoRA run")
  c.add_argument("--adapter", default="", help="with lora.max_lora_adapters > 1: the name of the adapter to export")
  d = sub.add_parser("peft-to-lora", help="Hugging Face PEFT adapter -> adapters checkpoint for lora.lora_restore_path")
  d.add_argument("--peft-dir", required=True)
  d.add_argument("--out", required=True)
  d.add_argument("--config", nargs="+", required=True, help="config file and key=value of the base model (e.g. maxtext_model.yml)")
  args = parser.parse_args(argv)
  try:
    _run(args)
  except Exception as e:
    error = outputs.as_user_error(e, args.out, 0, "the conversion output", "Choose another --out (nothing is left to clean up)")
    if error is None:
      raise
    raise error from None


def _run(args: argparse.Namespace) -> None:
  if args.command == "hf-to-maxtext":
    hf_to_maxtext(args.hf_dir, args.out, args.overrides)
  elif args.command == "maxtext-to-hf":
    maxtext_to_hf(args.checkpoint, args.out, args.config)
  elif args.command == "lora-to-peft":
    from maxtext.convert import peft

    print(peft.export(args.checkpoint, args.out, args.config, merged=args.merge, adapter=args.adapter))
  else:
    from maxtext.convert import peft

    print(f"train with: {peft.import_adapter(args.peft_dir, args.out, args.config)}")


if __name__ == "__main__":
  main(sys.argv[1:])
