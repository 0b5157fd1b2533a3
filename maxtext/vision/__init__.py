"""Vision towers, their projectors, image preprocessing and Hugging Face weight mappings (docs/vision.md)."""
