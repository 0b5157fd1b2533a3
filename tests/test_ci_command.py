"""CI runs exactly the test command the README prints (README.md, Tests)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command():
  readme = (ROOT / "README.md").read_text()
  tests = readme[readme.index("## Tests") :]
  printed = re.search(r"```bash\n(python -m pytest [^\n]*)\n```", tests).group(1)
  ci = [line.split("||")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python -m pytest")]
  assert ci == [printed], f"README prints {printed!r}; .ci/run runs {ci}"
