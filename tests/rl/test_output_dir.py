"""One run per output directory, checked before anything loads; exported models appear whole or not at all."""

import subprocess
import sys
import textwrap

import pytest

from tandem.cli import main
from tandem.errors import OutputDirInUseError
from tandem.files import atomic_directory
from tandem.rl import RLTrainer
from tandem.run.output_dir import OutputDirLock
from tests.rl.conftest import small_config

HOLD_LOCK = textwrap.dedent(
    """
    import sys
    from tandem.run.output_dir import OutputDirLock
    with OutputDirLock(sys.argv[1], "trainer.output_dir"):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes our stdin
    """
)


def test_a_second_run_in_a_held_output_dir_is_refused_naming_the_holder(rl_files, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        trainer = RLTrainer(small_config(rl_files, out, "data.val_path=", "trainer.total_steps=1"))
        with pytest.raises(
            OutputDirInUseError,
            match=rf"trainer.output_dir={out} is in use by another run \(pid {holder.pid}\)",
        ):
            trainer.fit()
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert trainer.fit().history  # the holder is gone: the same trainer now runs


def test_the_lock_is_released_when_a_run_ends_or_fails(tmp_path):
    second = OutputDirLock(tmp_path, "trainer.output_dir")
    with OutputDirLock(tmp_path, "trainer.output_dir"), pytest.raises(OutputDirInUseError):
        second.__enter__()  # a second holder in the same process is refused too
    with pytest.raises(KeyError), OutputDirLock(tmp_path, "trainer.output_dir"):
        raise KeyError("boom")
    with OutputDirLock(tmp_path, "trainer.output_dir"):
        pass


def test_an_output_dir_that_is_a_file_is_an_error_before_the_model_loads(rl_files, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    with pytest.raises(ValueError, match=rf"trainer.output_dir={taken}: the file is in the way"):
        RLTrainer(small_config(rl_files, taken))
    with pytest.raises(ValueError, match=rf"trainer.output_dir={taken / 'sub'}: its parent {taken}, a file"):
        RLTrainer(small_config(rl_files, taken / "sub"))
    args = [
        f"model_path={rl_files['model']}",
        f"data.train_path={rl_files['train']}",
        f"trainer.output_dir={taken}",
    ]
    assert main(["train", *args]) == 2  # through the command line: a message and exit code 2
    assert f"trainer.output_dir={taken}: the file is in the way" in capsys.readouterr().err


def test_atomic_directory_keeps_the_old_contents_when_the_writer_dies(tmp_path):
    target = tmp_path / "hf_model"
    with atomic_directory(target) as staging:
        (staging / "weights").write_text("v1")
    writer = textwrap.dedent(
        f"""
        import os
        from tandem.files import atomic_directory
        with atomic_directory({str(target)!r}) as staging:
            (staging / "weights").write_text("half of v2")
            os._exit(9)  # killed mid-export
        """
    )
    assert subprocess.run([sys.executable, "-c", writer], timeout=60).returncode == 9
    assert [p.name for p in target.iterdir()] == ["weights"] and (target / "weights").read_text() == "v1"
    with atomic_directory(target) as staging:  # the next export replaces it whole
        (staging / "weights").write_text("v2")
    assert (target / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
