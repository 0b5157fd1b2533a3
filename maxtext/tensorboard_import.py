"""Import tensorboardX without torch: its writer imports torch when torch is installed (about 2 CPU seconds per
process) only to accept torch tensors, which maxtext never passes."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_tensorboardx(name: str = "tensorboardX") -> ModuleType:
  """Import `name` (tensorboardX or one of its submodules) with `import torch` failing inside, unless torch is
  already loaded; later imports of torch work as usual."""
  if "torch" in sys.modules or "tensorboardX" in sys.modules:
    return importlib.import_module(name)
  sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError, which tensorboardX catches
  try:
    return importlib.import_module(name)
  finally:
    del sys.modules["torch"]
