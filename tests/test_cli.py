"""The ``zeroray`` command on bad input: one line on stderr and exit 2, never a traceback; ``ls`` of a
path that does not exist, of S3 without credentials, and of a checkpoint missing a rank file; ``export``
that fails midway or re-exports into the same directory leaves no partial or stale shards; a newcomer's
wrong folder (``ls`` of a checkpoint or of a folder of runs, ``export`` of a folder that is not there)
named as such; ``--version``; ``plot``'s default folder named from the URL, never from run.json."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

import zeroray
import zeroray.checkpoint as zc
from tests.support.checkpoint import make_engine
from tests.support.models import batches
from tests.support.recipe import train
from zeroray.checkpoint.manifest import rank_file
from zeroray.cli import main
from zeroray.monitoring.plot import FILES

REPO = Path(__file__).resolve().parent.parent


def _one_line_error(capsys: pytest.CaptureFixture, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["estimate", "--params", "7B", "--world-size", "0"], ["--world-size", "must be >= 1"]),
        (["estimate", "--params", "7B", "--world-size", "-2"], ["--world-size", "must be >= 1"]),
        (["estimate", "--params", "0", "--world-size", "8"], ["--params", "finite number >= 1"]),
        (["estimate", "--params", "nan", "--world-size", "8"], ["--params", "'nan'"]),
        (["estimate", "--params", "inf", "--world-size", "8"], ["--params", "'inf'"]),
        (["estimate", "--params", "-1e9", "--world-size", "8"], ["--params"]),
        (["estimate", "--params", "7B", "--world-size", "8", "--optimizer-bytes", "-4"], ["must be >= 0"]),
        (["export", "ckpt", "out", "--max-shard-size", "5XB"], ["--max-shard-size", "not a size: '5XB'"]),
        (["export", "ckpt", "out", "--max-shard-size", "0"], ["--max-shard-size", "at least 1 byte"]),
        (["ls", "run", "-o", "novalue"], ["is not KEY=VALUE"]),
    ],
)
def test_bad_values_are_one_line_and_exit_2(argv: list[str], words: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    _one_line_error(capsys, *words)


def test_console_script_prints_no_traceback() -> None:
    """The same through a real process, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "zeroray.cli", "estimate", "--params", "nan", "--world-size", "0"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A committed world-1, stage-2 checkpoint of a run."""
    run = tmp_path_factory.mktemp("cli") / "run"
    engine = make_engine(2)
    train(engine, batches(0, 1))
    url = zc.checkpoint_url(str(run), 1)
    zc.save(engine, url)
    engine.close()
    return url


def test_ls_of_a_path_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ls", str(tmp_path / "nope")]) == 2
    _one_line_error(capsys, "nope does not exist")


def test_ls_of_s3_without_credentials(s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    missing = str(Path(__file__).parent / "no-such-aws-file")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
    monkeypatch.setenv("AWS_CONFIG_FILE", missing)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    endpoint = s3["options"]["endpoint_url"]
    import s3fs

    try:
        assert main(["ls", f"{s3['bucket']}/run", "-o", f"endpoint_url={endpoint}"]) == 2
        _one_line_error(capsys, "NoCredentialsError")
    finally:  # fsspec caches filesystems by their arguments: later tests must not get this credential-less one
        s3fs.S3FileSystem.clear_instance_cache()


def test_ls_checks_rank_files_without_reading(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = Path(ckpt).parent
    assert main(["ls", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["1", "yes"]
    copy = tmp_path / "run"
    shutil.copytree(ckpt, copy / "checkpoint_1")
    shutil.copytree(ckpt, copy / "checkpoint_2")
    (copy / "checkpoint_2" / rank_file(0)).unlink()
    assert main(["ls", str(copy)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["1", "yes"], ["2", "broken"]]
    assert "rank-00000.bin is missing" in lines[2]


def test_export_into_a_file_is_refused(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep me")
    assert main(["export", ckpt, str(target)]) == 2
    _one_line_error(capsys, "is a file, not a directory")
    assert target.read_bytes() == b"keep me"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert main(["export", ckpt, str(tmp_path / "mine")]) == 2
    _one_line_error(capsys, "notes.txt")
    assert sorted(os.listdir(tmp_path)) == ["mine", "model.bin"]


def test_failed_export_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Damage in a late chunk of the rank file: the first output files are written before export
    reads it and fails; none of them (nor a temporary directory) is left."""
    engine = make_engine(2, vocab=4000, d=384)  # ~55 MB checkpoint: many 4 MiB chunks
    url = str(tmp_path / "checkpoint_1")
    zc.save(engine, url)
    engine.close()
    manifest = zc.CheckpointReader(url).manifest
    (f,) = manifest.files
    weights = sorted(s.offset for s in f.sections if s.key == "weight")
    assert weights[-1] // f.chunk_bytes > weights[0] // f.chunk_bytes + 1
    with open(Path(url) / f.path, "r+b") as fh:
        fh.seek(weights[-1] + 100)
        byte = fh.read(1)
        fh.seek(weights[-1] + 100)
        fh.write(bytes([byte[0] ^ 1]))
    assert main(["export", url, str(tmp_path / "hf"), "--max-shard-size", "1MB"]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1"]


def test_re_export_leaves_no_stale_shards(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hf"
    assert main(["export", ckpt, str(out), "--max-shard-size", "2KB"]) == 0
    many = capsys.readouterr().out.split()
    assert len(many) > 3 and sorted(os.listdir(out)) == sorted(many)
    assert main(["export", ckpt, str(out), "--dtype", "bf16"]) == 0
    files = capsys.readouterr().out.split()
    assert files == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert sorted(os.listdir(out)) == sorted(files) and sorted(os.listdir(tmp_path)) == ["hf"]
    assert len(load_file(out / files[0])) > 3


# ------------------------------------------------------------------------------ a newcomer's paths


def test_version() -> None:
    done = subprocess.run([sys.executable, "-m", "zeroray.cli", "--version"], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout == f"zeroray {zeroray.__version__}\n", done
    assert zeroray.__version__ == importlib.metadata.version("zeroray")  # pyproject.toml's


def test_ls_of_a_checkpoint_folder_names_the_run_folder(ckpt: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["ls", ckpt]) == 2
    _one_line_error(capsys, f"{ckpt} is a checkpoint, not a run", f"zeroray ls {Path(ckpt).parent}")


def test_ls_of_a_folder_of_runs_names_a_run(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for run in ("run-b", "run-a"):
        shutil.copytree(ckpt, tmp_path / run / "checkpoint_1")
    (tmp_path / "notes").mkdir()
    assert main(["ls", str(tmp_path)]) == 2
    _one_line_error(capsys, "holds 2 runs (run-a, run-b)", f"zeroray ls {tmp_path / 'run-a'}")
    (tmp_path / "empty-run").mkdir()
    assert main(["ls", str(tmp_path / "empty-run")]) == 0  # a run that has not saved yet
    assert capsys.readouterr().out == f"no checkpoints under {tmp_path / 'empty-run'}\n"


def test_export_of_a_folder_that_does_not_exist_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Not "the save did not finish": there was no save."""
    missing = tmp_path / "run" / "checkpoint_7"
    assert main(["export", str(missing), str(tmp_path / "hf")]) == 2
    err = _one_line_error(capsys, f"{missing} does not exist")
    assert "did not finish" not in err
    missing.mkdir(parents=True)
    assert main(["export", str(missing), str(tmp_path / "hf")]) == 1
    _one_line_error(capsys, "not a committed checkpoint", "the save did not finish")


@pytest.mark.parametrize("name", ["../escaped", "{tmp}/absolute", "s3-bucket/../../escaped"])
def test_plot_default_out_comes_from_the_url_not_from_run_json(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """run.json is storage content: its ``name`` may be absolute or climb out of the working directory."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "runs" / "my-run"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": name.format(tmp=tmp_path), "status": "FINISHED"}))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"loss": 3.0 - i, "_global_step": i, "_time_s": float(i)}) + "\n" for i in (1, 2)))
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert main(["plot", str(run)]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(written) == sorted(f"my-run-plots/{f}" for f in FILES)
    assert sorted(os.listdir(work / "my-run-plots")) == sorted(FILES)
    assert sorted(p.name for p in tmp_path.rglob("*-plots")) == ["my-run-plots"]
    assert sorted(os.listdir(tmp_path)) == ["runs", "work"]


def test_wrong_folders_on_s3(
    ckpt: str, s3: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The same hints on an object store, which has no directories, only key prefixes."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3["options"])
    root = f"{s3['bucket']}/results"
    for name in sorted(os.listdir(ckpt)):
        fs.put_file(str(Path(ckpt) / name), f"{root}/run-a/checkpoint_1/{name}")
    opts = [f"-o{k}={v}" for k, v in s3["options"].items()]
    assert main(["ls", f"{root}/run-a", *opts]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["1", "yes"]
    assert main(["ls", root, *opts]) == 2
    _one_line_error(capsys, "holds 1 runs (run-a)", f"zeroray ls {root}/run-a")
    assert main(["ls", f"{root}/run-a/checkpoint_1", *opts]) == 2
    _one_line_error(capsys, "is a checkpoint, not a run", f"zeroray ls {root}/run-a")
    assert main(["export", f"{root}/run-a/checkpoint_9", str(tmp_path / "hf"), *opts]) == 2
    _one_line_error(capsys, f"{root}/run-a/checkpoint_9 does not exist")
