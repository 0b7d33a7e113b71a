"""The run report's predicted-against-measured lines (zplan/trainer/report.py compare_lines)."""

from zplan.trainer.report import MIN_TRACKED_STEPS, compare_lines


def _report(measured_peak, device="cpu"):
    return {"device": device, "warnings": [],
            "measured": {"peak_memory_bytes": measured_peak, "peak_reserved_bytes": None,
                         "step_s": 0.5, "elements_per_step": 1000},
            "predicted": {"peak_memory_bytes": 3 * 2**20, "peak_reserved_bytes": None,
                          "step_s": 0.4, "elements_per_step": 1000}}


def _row(lines, label):
    return next(ln for ln in lines if ln.startswith(label)).split()


def test_a_peak_not_measured_reads_as_a_dash_and_says_why():
    lines = compare_lines(_report(None))
    row = _row(lines, "peak allocated per rank")
    assert row[-1] == "-" and row[-3:-1] == ["3.0", "MiB"]  # no error column without a measurement
    assert any(ln.startswith("peak allocated: not measured") and f"at least {MIN_TRACKED_STEPS} steps" in ln
               for ln in lines)


def test_a_resumed_launch_too_short_to_track_says_how_many_steps_it_trained():
    """Resumed at step 5 with --steps 8, a launch trains 3 steps: the note asked for "a run of at
    least 5 steps: --steps" though --steps was 8 (a QA pass); it names what this launch trained
    and the --steps that would track it."""
    lines = compare_lines({**_report(None), "start_step": 5, "end_step": 8})
    note = next(ln for ln in lines if ln.startswith("peak allocated: not measured"))
    assert "trained 3, steps 5..8" in note and f"--steps {5 + MIN_TRACKED_STEPS} or more" in note
    # long enough and still not measured: the tracker was off, no --steps would help (a review)
    lines = compare_lines({**_report(None), "start_step": 5, "end_step": 5 + MIN_TRACKED_STEPS})
    note = next(ln for ln in lines if ln.startswith("peak allocated: not measured"))
    assert "--steps" not in note and "--no-memory" in note


def test_a_measured_peak_has_its_error_and_no_note():
    lines = compare_lines(_report(4 * 2**20))
    assert _row(lines, "peak allocated per rank")[-1] == "-25.0%"  # (3 - 4) / 4
    assert not any("not measured" in ln for ln in lines)
    assert _row(lines, "step time")[-1] == "-20.0%"  # (400 - 500) / 500


def test_offload_all_on_cpu_ranks_says_what_its_memory_is_compared_with():
    """A CPU rank has no device to offload to: the report compares offload-all's peak with
    zero3's prediction and now says so (the run-half QA pass read 35.0 MiB predicted against
    estimate --plan's 18.4 MB unexplained); other strategies and GPUs print no such line."""
    from zplan.trainer.report import compare_lines
    report = {"device": "cpu", "strategy": "offload-all", "measured": {"peak_memory_bytes": 36 << 20},
              "predicted": {"peak_memory_bytes": 35 << 20}}
    assert any("compared with zero3's prediction" in l for l in compare_lines(report))
    for device, strategy in (("cpu", "zero3"), ("cuda", "offload-all")):
        lines = compare_lines({**report, "device": device, "strategy": strategy})
        assert not any("zero3's prediction" in l for l in lines)


def test_a_resumed_runs_report_keeps_the_earlier_parts(tmp_path):
    """A resume wrote a report of the resumed steps only, and the earlier losses were gone (the
    run-half QA pass): the earlier report is kept as run_report.steps{A}-{B}.json; a report of
    the same start replaces as before."""
    import json

    from zplan.trainer.report import write_report
    first = {"start_step": 0, "end_step": 3, "losses": [3.0, 2.9, 2.8]}
    write_report(first, str(tmp_path))
    write_report({**first, "losses": [3.0, 2.9, 2.7]}, str(tmp_path))
    assert not list(tmp_path.glob("run_report.steps*"))
    write_report({"start_step": 3, "end_step": 5, "losses": [2.6, 2.5]}, str(tmp_path))
    kept = json.loads((tmp_path / "run_report.steps0-3.json").read_text())
    assert kept["losses"] == [3.0, 2.9, 2.7]
    assert json.loads((tmp_path / "run_report.json").read_text())["start_step"] == 3


def test_an_earlier_report_with_odd_fields_is_replaced_not_followed(tmp_path):
    """The earlier report is data: an end_step that is not a whole number (a path, say) keeps
    nothing and names no file from it."""
    import json

    from zplan.trainer.report import write_report
    for end in ("../../x", 10**300):  # a path; a name too long for any filesystem (the review)
        (tmp_path / "run_report.json").write_text(json.dumps({"start_step": 0, "end_step": end}))
        write_report({"start_step": 3, "end_step": 5, "losses": []}, str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run_report.json"]
        assert json.loads((tmp_path / "run_report.json").read_text())["start_step"] == 3


def test_cpu_ranks_say_their_step_time_does_not_test_the_time_model():
    """On CPU ranks the step time is off by 8x either way (nominal preset: +714%; calibrated:
    -86%, the tiny model's step dominated by per-op dispatch): the report says what those rows
    are; a GPU run's report does not."""
    assert any(ln.startswith("step time, tokens/s, MFU on CPU ranks") for ln in compare_lines(_report(4 * 2**20)))
    assert not any("CPU ranks" in ln for ln in compare_lines(_report(4 * 2**20, device="cuda")))


def test_a_resume_on_other_data_is_said(tmp_path, monkeypatch):
    """--resume with another --data than the run's report names (or none where it had one) is
    said before the ranks start; the same file by another spelling, a missing or odd report say
    nothing."""
    import json

    from zplan.launch.run_dir import resumed_data_note

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    report = tmp_path / "run_report.json"
    assert resumed_data_note(tmp_path, "a.txt") is None  # no report yet
    for before, now, said in ((None, None, False), (None, "a.txt", True), ("a.txt", None, True),
                              ("a.txt", str(tmp_path / "a.txt"), False), ("a.txt", "b.txt", True)):
        report.write_text(json.dumps({"config": {"data": before}}))
        note = resumed_data_note(tmp_path, now)
        assert (note is not None) == said, (before, now, note)
        if said:
            assert (before or "built-in") in note and (now or "no --data") in note
    for odd in ("[1, 2]", '{"config": {"data": 7}}', "not json"):
        report.write_text(odd)
        assert resumed_data_note(tmp_path, "a.txt") is None


def test_a_step_line_over_the_presets_peak_says_so():
    """CPU ranks priced on the nominal 'cpu' preset printed 'MFU 160.5%' in every step line with
    no word; the final report warned. A step line past 100% names the preset it exceeds."""
    from types import SimpleNamespace

    from tests.test_contract import plan_for
    from zplan.trainer.report import flop_per_step, peak_flops, step_log_line

    plan = plan_for("zero3")
    tr = SimpleNamespace(plan=plan)
    fast = flop_per_step(plan) / peak_flops(plan) / 1.6  # a step at 160% of the preset's peak
    line = step_log_line(tr, 3, 10, 2.0, fast, (2**30, 2**31))
    assert "MFU 160.0% (over the 'cpu' preset's peak)" in line
    assert "over the" not in step_log_line(tr, 3, 10, 2.0, fast * 2, (2**30, 2**31))  # 80%: as before
