"""The one reader and the one writer (zplan/files.py), on real files, FIFOs, devices and links."""

import json
import os
import stat
import threading

import pytest

from zplan import files
from zplan.errors import UsageError


def _timeout(fn, seconds=5.0):
    """Run fn in a thread; fail if it blocks (a FIFO read waits for a writer forever)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_catch(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    return out["r"]


def _catch(fn):
    try:
        return fn()
    except UsageError as e:
        return e


def test_fifo_directory_and_device_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory"), ("/dev/zero", "a character device")):
        err = _timeout(lambda: files.read_json(path, "plan"))
        assert isinstance(err, UsageError) and f"plan {path} is {kind}" in str(err)


def test_size_limit(tmp_path):
    p = tmp_path / "big.toml"
    p.write_bytes(b"#" * (files.MAX_INPUT_BYTES + 1))
    with pytest.raises(UsageError, match=r"big\.toml is 8,388,609 bytes, over the limit"):
        files.read_toml(p, "preset")


def test_not_utf8_names_the_byte(tmp_path):
    p = tmp_path / "latin.toml"
    p.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(UsageError, match=r"latin\.toml is not UTF-8 text \(byte 11\)"):
        files.read_toml(p, "preset")


def test_bom_is_dropped(tmp_path):
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"a": 1}).encode())
    assert files.read_json(p, "plan") == {"a": 1}


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 40 + "1" + "}" * 40])
def test_deep_json_is_refused(tmp_path, text):
    p = tmp_path / "deep.json"
    p.write_text(text)
    with pytest.raises(UsageError, match=f"nests deeper than {files.MAX_DEPTH} levels"):
        files.read_json(p, "plan")


def test_brackets_inside_strings_do_not_count(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps({"source": "[" * 1000 + '\\"{'}))
    assert files.read_json(p, "plan")["source"].startswith("[[[")


def test_dotted_toml_keys_nest_without_brackets(tmp_path):
    p = tmp_path / "dots.toml"
    p.write_text(".".join(["k"] * 200) + " = 1\n")
    with pytest.raises(UsageError, match="nests deeper than"):
        files.read_toml(p, "preset")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_json_nan_and_infinity_are_refused(tmp_path, token):
    p = tmp_path / "plan.json"
    p.write_text('{"step_s": %s}' % token)
    with pytest.raises(UsageError, match=f"plan {p} is not usable JSON.*{token}"):
        files.read_json(p, "plan")


def test_write_gives_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o027)
    try:
        files.write_text(tmp_path / "a.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o640


def test_write_keeps_an_existing_files_mode(tmp_path):
    p = tmp_path / "job.sh"
    p.write_text("old")
    os.chmod(p, 0o751)
    files.write_text(p, "new")
    assert p.read_text() == "new" and stat.S_IMODE(os.stat(p).st_mode) == 0o751


def test_write_through_a_symlink_keeps_the_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    files.write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


@pytest.mark.parametrize("special", ["dir", "fifo", "/dev/null"])
def test_write_refuses_special_targets_and_leaves_nothing(tmp_path, special):
    if special == "dir":
        target, kind = tmp_path / "out", "a directory"
        target.mkdir()
    elif special == "fifo":
        target, kind = tmp_path / "out", "a FIFO"
        os.mkfifo(target)
    else:
        target, kind = special, "a character device"
    err = _timeout(lambda: files.write_text(target, "x", "plot"))
    assert isinstance(err, UsageError) and f"plot {target} is {kind}" in str(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if special != "/dev/null" else [])


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "plan.json"
    p.write_text("old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(files.FileWriteError, match=f"cannot write plan {p}: No space left on device"):
        files.write_text(p, "new", "plan")
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["plan.json"]


def test_write_under_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="cannot write output .*afile/out.json: Not a directory"):
        files.write_text(tmp_path / "afile" / "out.json", "x")


def test_atomic_writer_streams_and_leaves_old_file_on_error(tmp_path):
    """The streaming form (consolidate writes through it): a failure mid-stream keeps the old
    file and leaves no temporary; success gets the umask's mode, not mkstemp's 0600."""
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"old")
    try:
        with files.atomic_writer(out, "weights") as f:
            f.write(b"half")
            raise RuntimeError("rank died")
    except RuntimeError:
        pass
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
    new = tmp_path / "n.pt"
    old_mask = os.umask(0o022)
    try:
        with files.atomic_writer(new, "weights") as f:
            f.write(b"a")
            f.write(b"b")
    finally:
        os.umask(old_mask)
    assert new.read_bytes() == b"ab" and stat.S_IMODE(new.stat().st_mode) == 0o644


def test_named_outputs_never_replace_what_the_user_wrote(tmp_path, capsys, monkeypatch):
    """The QA pass: recommend --write replaced a notes file and export -o replaced the plan it
    read with its DeepSpeed config, both exit 0. Now: --write replaces only a plan, an export
    never replaces a plan (the one it reads least of all), a missing folder is named rather
    than created, an empty name is refused; each in one line, exit 2, the file as it was."""
    import json

    from tests.helpers import cli
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "p.json"
    r = cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--write", str(plan))
    assert r.returncode == 0 and json.loads(plan.read_text())["plan_version"] == 1
    before = plan.read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    cases = [(("recommend", "--model", "tiny", "--gpus", "2", "--write", str(notes)), "is not a zplan plan", notes),
             (("export", "--plan", str(plan), "--to", "deepspeed", "-o", str(plan)), "is the file this command reads", plan),
             (("export", "--plan", str(plan), "--to", "deepspeed", "-o", "p.json"), "is the file this command reads", plan),
             (("recommend", "--model", "tiny", "--gpus", "2", "--write", ""), "--write '' is empty", None),
             (("export", "--plan", str(plan), "--to", "torchrun", "-o", ""), "--output '' is empty", None),
             (("export", "--plan", str(plan), "--to", "torchrun", "-o", str(tmp_path / "no" / "x.sh")),
              "the folder", None)]
    for args, needle, kept in cases:
        r = cli(capsys, *args)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        if kept is not None:
            assert kept.read_bytes() == (before if kept == plan else b"mine")
    assert not (tmp_path / "no").exists()
    other = tmp_path / "other.json"
    other.write_bytes(before)
    r = cli(capsys, "export", "--plan", str(plan), "--to", "deepspeed", "-o", str(other))
    assert r.returncode == 2 and "is a zplan plan" in r.stderr and other.read_bytes() == before
    # what zplan wrote itself is replaced: a plan by --write, an export by export
    r = cli(capsys, "recommend", "--model", "tiny", "--gpus", "4", "--write", str(plan))
    assert r.returncode == 0 and json.loads(plan.read_text())["num_gpus"] == 4
    ds = tmp_path / "ds.json"
    for _ in range(2):
        assert cli(capsys, "export", "--plan", str(plan), "--to", "deepspeed", "-o", str(ds)).returncode == 0
    assert "zero_optimization" in json.loads(ds.read_text())


def test_a_refused_run_directory_leaves_no_folder(tmp_path):
    """check_run_dir removes the folders it made when it refuses (no room for a checkpoint), as
    launch --dry-run left an empty runs/<time>/ behind; a folder that was there stays."""
    from zplan.errors import PlanError
    from zplan.launch.run_dir import check_run_dir

    target = tmp_path / "a" / "b" / "c"
    with pytest.raises(PlanError, match="GB free but one checkpoint needs"):
        check_run_dir(target, need_bytes=10**20)
    assert not (tmp_path / "a").exists() and tmp_path.exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(PlanError):
        check_run_dir(tmp_path / "kept", need_bytes=10**20)
    assert (tmp_path / "kept").is_dir()


def test_named_outputs_edge_cases_the_review_found(tmp_path, capsys, monkeypatch):
    """mktemp's empty file takes a plan (scripts create the target first); --write and --plot
    naming one file are refused (the plot would replace the plan); a dangling link into a
    missing folder is refused, not followed into a new folder."""
    import os

    from tests.helpers import cli
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    assert cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--write", str(empty)).returncode == 0
    assert b"plan_version" in empty.read_bytes()
    r = cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--write", "same.json", "--plot", "./same.json")
    assert r.returncode == 2 and "name the same file" in r.stderr and not (tmp_path / "same.json").exists()
    for name in ("p.svg", "p.txt"):  # PNG data was written into them
        r = cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--plot", name)
        assert r.returncode == 2 and "ending in .png" in r.stderr and not (tmp_path / name).exists()
    os.symlink("nodir/x.json", tmp_path / "dl.json")
    r = cli(capsys, "recommend", "--model", "tiny", "--gpus", "2", "--write", "dl.json")
    assert r.returncode == 2 and "does not exist" in r.stderr and not (tmp_path / "nodir").exists()


def test_a_number_of_thousands_of_digits_is_one_line_without_pythons_advice(tmp_path):
    """json.loads refuses an integer of over 4300 digits with Python's "use
    sys.set_int_max_str_digits() to increase the limit", which the line passed on (cut mid-word)."""
    from zplan.errors import UsageError
    from zplan.files import read_json

    f = tmp_path / "p.json"
    f.write_text('{"num_gpus": ' + "9" * 5000 + "}")
    with pytest.raises(UsageError) as e:
        read_json(f, "plan")
    assert "thousands of digits" in str(e.value) and "set_int_max_str_digits" not in str(e.value)
