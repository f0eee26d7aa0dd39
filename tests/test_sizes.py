"""No module of the package over 600 lines and no function over 60 (issue #52; STYLE.md rules 1
and 5), counted from the source with ``ast``: a function's lines run from its ``def`` to its last
line, docstring included. The ones that predate the rule are listed by name; a new one fails."""

import ast
from pathlib import Path

from tests.conftest import ROOT

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

# Over the limits before the rule; each leaves this list when it is split or shortened.
LONG_MODULES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()


def function_lines(source: str) -> dict[str, int]:
    """Lines of each function (methods and nested ones too) of ``source``, by name; the longest
    when a name repeats."""
    lines: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines[node.name] = max(lines.get(node.name, 0), node.end_lineno - node.lineno + 1)
    return lines


def test_function_lines_match_a_count_by_hand():
    source = (
        "def f(x):\n"  # 1: f starts
        '    """Doc."""\n'
        "\n"
        "    return x\n"  # 4: f ends
        "\n"
        "class A:\n"
        "    async def g(self):\n"  # 7: g starts
        "        def h():\n"
        "            pass\n"
        "        return h\n"  # 10: g ends
    )
    assert function_lines(source) == {"f": 4, "g": 4, "h": 2}


def test_no_new_module_over_600_lines_and_no_new_function_over_60():
    long_modules, long_functions = {}, {}
    for path in sorted(Path(ROOT, "tandem").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES and name not in LONG_MODULES:
            long_modules[name] = len(source.splitlines())
        for function, lines in function_lines(source).items():
            if lines > MAX_FUNCTION_LINES and f"{name}:{function}" not in LONG_FUNCTIONS:
                long_functions[f"{name}:{function}"] = lines
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines (shorten them): {long_functions}"
