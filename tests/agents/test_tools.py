"""Tool-call parsing, the calculator, user tools from a file, and the runner's error handling."""

import pytest

from tandem.agents.tool_calls import TOOL_CALL_PARSERS, ToolCall, parse_hermes
from tandem.agents.tools import CALCULATOR, ToolRunner, calculate, load_user_tools, tool_from_function


def test_hermes_parses_calls_and_keeps_the_prose():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    turn = TOOL_CALL_PARSERS.get("hermes")(text)
    assert turn.text == "Let me compute."
    assert turn.calls == [
        ToolCall("calculator", {"expression": "12*34"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert turn.errors == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{name: calculator}", "not valid JSON"),
        ('["calculator"]', "expected a JSON object"),
        ('{"arguments": {}}', "no tool 'name'"),
        ('{"name": "calculator", "arguments": [1]}', "'arguments' must be a JSON object"),
        ('{"name": "calculator", "arguments": "{oops"}', "'arguments' is a string that is not valid JSON"),
    ],
)
def test_malformed_calls_become_errors_and_the_good_ones_still_run(body, message):
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    turn = parse_hermes(f"<tool_call>{body}</tool_call>{good}")
    assert turn.calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert len(turn.errors) == 1 and message in turn.errors[0] and turn.errors[0].startswith("tool call 0")


def test_an_unclosed_block_is_an_error():
    turn = parse_hermes('<tool_call>{"name": "calculator", "arguments": {}}')
    assert turn.calls == [] and "not closed" in turn.errors[0]


def test_the_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculate("1234 * 5678") == str(1234 * 5678)
    assert calculate("(7 + 5) / 4") == "3" and calculate("7 / 2") == "3.5" and calculate("-2 ** 3") == "-8"
    for expression, message in [
        ("__import__('os')", "not arithmetic"),
        ("2 ** 1000", "exponent"),
        ("1 +", "not an expression"),
    ]:
        with pytest.raises(ValueError, match=message):
            calculate(expression)


def test_the_runner_returns_errors_to_the_model_and_counts_them():
    runner = ToolRunner([CALCULATOR], concurrency=2)
    calls = [
        ToolCall("calculator", {"expression": "6*7"}),
        ToolCall("search", {"query": "x"}),
        ToolCall("calculator", {}),
        ToolCall("calculator", {"expression": 5}),
        ToolCall("calculator", {"expression": "1/0"}),
    ]
    results = runner.run(calls)
    assert results[0] == "42"
    assert results[1].startswith("error: unknown tool 'search'")
    assert results[2] == "error: missing argument(s) ['expression']"
    assert results[3] == "error: argument 'expression' must be a string, got int"
    assert results[4] == "error: ZeroDivisionError: division by zero"
    metrics = runner.stats.metrics()
    assert metrics["agent/tool/errors"] == 4.0
    assert metrics["agent/tool/calculator/calls"] == 4.0 and metrics["agent/tool/calculator/errors"] == 3.0
    assert metrics["agent/tool/unknown_tool/errors"] == 1.0
    runner.close()


def test_user_tools_come_from_a_file_with_schemas_from_their_signatures(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "def lookup(city: str, year: int = 2024) -> str:\n"
        '    """Population of a city.\n\n    Longer text."""\n'
        "    return f'{city}:{year}'\n"
        "TOOLS = [lookup]\n"
    )
    (tool,) = load_user_tools(str(path))
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Population of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
    assert ToolRunner([tool]).run([ToolCall("lookup", {"city": "Oslo"})]) == ["Oslo:2024"]
    (tmp_path / "bad.py").write_text("TOOLS = 3\n")
    with pytest.raises(ValueError, match="define TOOLS"):
        load_user_tools(str(tmp_path / "bad.py"))
    with pytest.raises(ValueError, match="needs a str, int, float or bool annotation"):
        tool_from_function(lambda x: x)
