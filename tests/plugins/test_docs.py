"""docs/extending.md shows each example plugin exactly as the file the tests run."""

import re
from pathlib import Path

from tests.conftest import ROOT
from tests.plugins.conftest import EXAMPLES


def test_each_example_in_the_docs_is_the_tested_file():
    page = (Path(ROOT) / "docs" / "extending.md").read_text()
    shown = dict(re.findall(r"```python\n# examples/plugins/(\w+\.py)\n(.*?)```", page, flags=re.S))
    assert sorted(shown) == sorted(path.name for path in EXAMPLES.glob("*.py"))
    for name, code in shown.items():
        assert code == (EXAMPLES / name).read_text(), name
