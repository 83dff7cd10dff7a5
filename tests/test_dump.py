"""``MULTIMESH_DUMP_IR_TO`` and failure repros: one place per program, safe under threads."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import PassFailure
from multimesh.tools.mm_opt import main as mm_opt


def _mesh(k: int) -> mm.TaskMesh:
    return mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))


def _program(tag: str):
    """A two-task program whose task names carry ``tag`` (so dumps can be told apart)."""
    a = mm.task(lambda x: x * 2, name=f"{tag}_a", mesh=_mesh(0))
    b = mm.task(lambda x: x + 1, name=f"{tag}_b", mesh=_mesh(1))

    def program(x):
        return b(a(x))

    program.__name__ = f"prog_{tag}"
    return program


def _broken(tag: str):
    """A program that fails in mm-resolve-logical-shardings: a constraint whose logical
    name the task maps to a device axis its mesh lacks."""
    a = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")), name=f"{tag}",
                mesh=_mesh(0), logical_axes=(("batch", "nope"),))

    def broken(x):
        return a(x)

    broken.__name__ = f"broken_{tag}"
    return broken


@pytest.fixture
def dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path))
    return tmp_path


def _check_dumps(d: Path, tag: str, other: str | None = None):
    files = sorted(p.name for p in d.iterdir())
    assert files[0] == "00-input.mlir" and files[-1].endswith("mm-extract-fragments.mlir"), files
    assert [f[:2] for f in files] == [f"{i:02d}" for i in range(len(files))]
    for f in files:
        text = (d / f).read_text()
        assert f"{tag}_a" in text, (d, f)
        if other is not None:
            assert f"{other}_a" not in text, (d, f)


def test_each_program_dumps_into_its_own_directory(dump_dir):
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(mm.mjit(_program("one"))(x), np.arange(8.0) * 2 + 1)
    np.testing.assert_array_equal(mm.mjit(_program("two"))(x), np.arange(8.0) * 2 + 1)
    mm.mjit(_program("one")).lower(x).compile()  # the same name again: a new directory
    assert sorted(p.name for p in dump_dir.iterdir()) == ["prog_one-0", "prog_one-1",
                                                          "prog_two-0"]
    _check_dumps(dump_dir / "prog_one-0", "one", other="two")
    _check_dumps(dump_dir / "prog_two-0", "two", other="one")
    _check_dumps(dump_dir / "prog_one-1", "one", other="two")


def test_programs_compiled_in_parallel_threads_keep_their_dumps_apart(dump_dir):
    tags = [f"t{i}" for i in range(4)]
    errors, barrier = [], threading.Barrier(len(tags))

    def compile_one(tag):
        try:
            barrier.wait(600)
            y = mm.mjit(_program(tag))(jnp.arange(8.0))
            np.testing.assert_array_equal(y, np.arange(8.0) * 2 + 1)
            assert sorted(d.id for d in y.devices()) == [4, 5, 6, 7]
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=compile_one, args=(t,)) for t in tags]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert sorted(p.name for p in dump_dir.iterdir()) == [f"prog_{t}-0" for t in tags]
    for t in tags:
        _check_dumps(dump_dir / f"prog_{t}-0", t, other=next(o for o in tags if o != t))


def _repro_file(e: PassFailure) -> Path:
    return Path(shlex.split(e.repro)[1])


def _replay(e: PassFailure) -> tuple[int, str]:
    argv = shlex.split(e.repro)[1:]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mm_opt(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("dumping", [False, True])
def test_concurrent_failures_write_their_own_repros(dumping, tmp_path, monkeypatch):
    if dumping:
        monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path))
    else:
        monkeypatch.delenv("MULTIMESH_DUMP_IR_TO", raising=False)
    tags = [f"f{i}" for i in range(3)]
    failures: dict[str, PassFailure] = {}
    barrier = threading.Barrier(len(tags))

    def fail(tag):
        barrier.wait(600)
        try:
            mm.mjit(_broken(tag))(jnp.ones(8))
        except PassFailure as e:
            failures[tag] = e

    threads = [threading.Thread(target=fail, args=(t,)) for t in tags]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert sorted(failures) == tags
    paths = {tag: _repro_file(e) for tag, e in failures.items()}
    assert len(set(paths.values())) == len(tags), paths
    try:
        for tag, e in failures.items():
            assert e.pass_argument == "mm-resolve-logical-shardings"
            text = paths[tag].read_text()
            assert f'name = "{tag}"' in text
            assert all(f'name = "{o}"' not in text for o in tags if o != tag)
            if dumping:
                assert paths[tag].parent == tmp_path / f"broken_{tag}-0"
            code, err = _replay(e)
            assert code == 1 and f"mesh of task '{tag}'" in err
    finally:
        if not dumping:
            for p in paths.values():
                os.unlink(p)


# --------------------------------------------------------------------------- bounded repros


@pytest.fixture
def no_dumps(monkeypatch):
    for name in ("MULTIMESH_DUMP_IR_TO", "MULTIMESH_REPRO_DIR", "MULTIMESH_REPRO_KEEP"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _fail(tag: str = "t") -> PassFailure:
    with pytest.raises(PassFailure, match=f"mesh of task '{tag}'") as e:
        mm.mjit(_broken(tag))(jnp.ones(8))
    return e.value


def test_repros_go_to_one_directory_per_user_under_the_temp_dir(no_dumps, tmp_path):
    import getpass
    import tempfile

    no_dumps.setattr(tempfile, "tempdir", str(tmp_path))
    e = _fail()
    path = _repro_file(e)
    assert path.parent == tmp_path / f"multimesh-repros-{getpass.getuser()}"
    assert path.name.startswith("multimesh-failed-input-") and path.suffix == ".mlir"
    assert path.parent.stat().st_mode & 0o777 == 0o700  # it holds the user's programs
    assert (f"(repros go to {path.parent}, which keeps the newest 20; MULTIMESH_REPRO_DIR "
            f"and MULTIMESH_REPRO_KEEP change that, MULTIMESH_REPRO_KEEP=0 turns them off)"
            in str(e))
    code, err = _replay(e)
    assert code == 1 and "mesh of task 't'" in err


def test_the_repro_directory_keeps_the_newest(no_dumps, tmp_path):
    no_dumps.setenv("MULTIMESH_REPRO_DIR", str(tmp_path / "repros"))
    no_dumps.setenv("MULTIMESH_REPRO_KEEP", "3")
    stray = tmp_path / "repros" / "notes.txt"  # not a repro: left alone
    stray.parent.mkdir()
    stray.write_text("mine")
    paths = []
    for i in range(5):
        e = _fail(f"t{i}")
        paths.append(_repro_file(e))
        assert "which keeps the newest 3" in str(e)
    left = sorted((tmp_path / "repros").iterdir())
    assert left == sorted([stray, *paths[2:]]), left  # the newest three
    for i, p in enumerate(paths[2:], 2):
        assert f'name = "t{i}"' in p.read_text()


def test_repros_can_be_turned_off(no_dumps, tmp_path):
    no_dumps.setenv("MULTIMESH_REPRO_DIR", str(tmp_path / "repros"))
    no_dumps.setenv("MULTIMESH_REPRO_KEEP", "0")
    e = _fail()
    assert e.repro is None
    assert str(e).endswith("No repro file was written: MULTIMESH_REPRO_KEEP=0 turns them off.")
    assert not (tmp_path / "repros").exists()


@pytest.mark.parametrize("keep, why", [
    ("-1", "MULTIMESH_REPRO_KEEP='-1' is not a whole number of files to keep, 0 or more "
           "(the default is 20)"),
    ("many", "MULTIMESH_REPRO_KEEP='many' is not a whole number"),
])
def test_a_bad_repro_setting_is_named_with_the_failure(no_dumps, tmp_path, keep, why):
    """The pass's failure is what is raised; the note says why there is no repro."""
    no_dumps.setenv("MULTIMESH_REPRO_DIR", str(tmp_path / "repros"))
    no_dumps.setenv("MULTIMESH_REPRO_KEEP", keep)
    e = _fail()
    assert e.repro is None and f"No repro file was written: {why}" in str(e), str(e)


def test_a_repro_directory_that_cannot_be_made_is_named(no_dumps, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    no_dumps.setenv("MULTIMESH_REPRO_DIR", str(blocker / "repros"))
    e = _fail()
    assert e.repro is None
    assert (f"No repro file was written: cannot make the repro directory "
            f"'{blocker / 'repros'}' (Not a directory); set MULTIMESH_REPRO_DIR to a "
            f"directory you can write." in str(e)), str(e)
