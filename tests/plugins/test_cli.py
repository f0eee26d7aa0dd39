"""``--plugin`` on the command line: ``tandem algos`` lists a plugin's names with their file, and a
broken plugin is one line on stderr, exit status 2."""

import argparse

from tandem.cli import build_parser, main
from tests.plugins.conftest import example


def test_every_command_takes_plugin_files():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"demo", "train", "sft", "dpo", "rm", "serve", "report", "prepare-data", "algos"} <= set(commands)
    for name, command in commands.items():
        (option,) = [action for action in command._actions if "--plugin" in action.option_strings]
        assert isinstance(option, argparse._AppendAction) and option.default == [], name
    assert parser.parse_args(["algos", "--plugin", "a.py", "--plugin", "b.py"]).plugin == ["a.py", "b.py"]


def test_algos_lists_a_plugin_s_names_beside_the_built_in_ones(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich's tables: no column cut short
    plugins = [
        example(kind) for kind in ("advantage_estimator", "kl_estimator", "agent_loop", "reward_function")
    ]
    assert main(["algos", *(item for path in plugins for item in ("--plugin", path))]) == 0
    rows = {
        line.split("│")[1].strip(): line
        for line in capsys.readouterr().out.splitlines()
        if line.count("│") > 3
    }
    assert "advantage_estimator.py" in rows["grpo_loop"] and "tandem" in rows["grpo"]
    assert "kl_estimator.py" in rows["k3_unclamped"] and "agent_loop.py" in rows["revise_once"]
    assert "reward_function.py" in rows["word_overlap"] and "tandem" in rows["single_turn"]


def test_a_broken_plugin_stops_any_command_with_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import numpyy\n")
    for command in (["algos"], ["train", "model_path=m"], ["report", "nowhere"]):
        assert main([*command, "--plugin", str(broken)]) == 2
        error = capsys.readouterr().err
        assert error == (
            f"tandem {command[0]}: error: --plugin={str(broken)!r}: line 1: "
            "ModuleNotFoundError: No module named 'numpyy'\n"
        )


def test_print_config_shows_the_plugins(capsys):
    main(["train", "--plugin", example("advantage_estimator"), "model_path=m", "data.train_path=t.parquet",
          "algorithm.adv_estimator=grpo_loop", "--print-config"])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"--plugin={example('advantage_estimator')}" in printed
    assert (
        f"plugins:\n- {example('advantage_estimator')}\n" in printed and "adv_estimator: grpo_loop" in printed
    )
