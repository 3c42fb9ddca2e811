"""``python -m dipc.train`` refuses options that cannot take effect (issue "The house": CLI options that cannot take
effect are refused): an argparse error naming the option and its value, exit code 2, before any process starts.
Everything here runs in this process (no spawn: the refusals come first)."""
import importlib.util
import os

import pytest

import dipc.train as train


def _refused(capsys, argv, *words):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "python -m dipc.train: error:" in err and all(w in err for w in words), err
    return err


@pytest.mark.parametrize("argv,words", [
    (["--steps", "5", "--report", "5"], ["--report 5", "--steps 5", "steps 0 to 4"]),
    (["--report", "-1"], ["--report -1"]),
    (["--steps", "0"], ["--steps must be at least 1, got 0"]),
    (["--pp", "0"], ["--pp must be at least 1, got 0"]),
    (["--batch-size", "-2"], ["--batch-size must be at least 1, got -2"]),
    (["--microbatches", "0"], ["--microbatches must be at least 1, got 0"]),
    (["--batch-size", "4", "--microbatches", "5"], ["--microbatches 5", "--batch-size 4"]),
    (["--lr", "-0.1"], ["--lr", "-0.1"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--timeout", "0.5"], ["--timeout", "0.5"]),
    (["--timeout", "inf"], ["--timeout", "inf"]),
    (["--seed", str(2 ** 64)], ["--seed", str(2 ** 64)]),
    (["--report-dir", "elsewhere"], ["--report-dir elsewhere", "only with --report"]),
    (["--steps", "abc"], ["--steps", "'abc'"]),  # argparse's own
])
def test_bad_values_are_refused(capsys, argv, words):
    _refused(capsys, ["--model", "vlm"] + argv, *words)


def test_output_folders_must_be_reachable(capsys, tmp_path):
    missing = tmp_path / "no" / "such"
    _refused(capsys, ["--model", "vlm", "--report", "0", "--report-dir", str(missing)], "--report-dir",
             str(missing), f"the folder {tmp_path / 'no'} does not exist")
    _refused(capsys, ["--model", "vlm", "--save", str(missing)], "--save", "does not exist")
    f = tmp_path / "a_file"
    f.write_text("")
    _refused(capsys, ["--model", "vlm", "--report", "0", "--report-dir", str(f)], str(f), "a file of that name")
    # a folder to be made in an existing one, or an existing one: accepted (nothing is started by parse_args)
    args = train.parse_args(["--model", "vlm", "--steps", "3", "--report", "2", "--report-dir",
                             str(tmp_path / "new"), "--save", str(tmp_path)])
    assert (args.report, args.steps, args.report_dir) == (2, 3, str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()


def test_defaults_are_accepted():
    args = train.parse_args([])
    assert (args.model, args.pp, args.steps, args.report, args.given) == ("llava", 2, 30, None, frozenset())


def test_pp_under_torchrun_and_llava_without_transformers(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    _refused(capsys, ["--model", "vlm", "--pp", "2"], "--pp 2", "WORLD_SIZE is 4")
    assert train.parse_args(["--model", "vlm", "--pp", "4"]).pp == 4
    assert train.parse_args(["--model", "vlm"]).pp == 2  # not given: torchrun's world size is used
    monkeypatch.delenv("RANK")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers"
                        else real(name, *a))
    _refused(capsys, ["--model", "llava"], "--model llava needs transformers")
    assert os.environ.get("RANK") is None
