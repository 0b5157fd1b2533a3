"""Regenerate configs/base.yml from the pydantic schema (run after editing sections.py or model_sections.py)."""

from pathlib import Path

from maxtext.config.render import render_base_yml

if __name__ == "__main__":
  out = Path(__file__).resolve().parents[1] / "configs" / "base.yml"
  out.write_text(render_base_yml())
  print(f"wrote {out}")
