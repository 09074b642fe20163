"""End to end: ``simstream demo --quick``, ``eval`` on its checkpoint, ``inspect``, and Ctrl-C cleanup."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import imageio.v3 as iio
import pytest
import torch

from simstream.bc.report import PLOTS
from simstream.cli.main import main as simstream
from simstream.engine.sizing import free_shared_bytes
from tests.support.processes import descendants, wait_for_exit

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    """One ``demo --quick`` run shared by the tests of this module (the expensive part)."""
    runs = tmp_path_factory.mktemp("runs")
    assert simstream(["demo", "--quick", "--runs-dir", str(runs), "--name", "quick"]) == 0
    return runs / "quick"


def _one_line(text: str) -> str:
    """A CLI error on one line: tyro draws it in a box and wraps long lines."""
    return " ".join(re.sub(r"[│|]", " ", text).split())


def test_demo_quick_writes_report_plots_checkpoint_and_summary(quick_run):
    for name in ("report.md", "summary.json", "training_log.json", "checkpoint.pt", *PLOTS):
        path = quick_run / name
        assert path.is_file() and path.stat().st_size > 0, name
    assert any((quick_run / "tensorboard").glob("events.out.tfevents.*"))
    for name in PLOTS:
        assert (quick_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary = json.loads((quick_run / "summary.json").read_text())
    final = summary["final_eval"]
    assert summary["quick"] is True and summary["task"] == "pick_place"
    assert final["episodes"] == summary["config"]["eval_episodes"] == 4
    assert 0 <= final["successes"] <= final["episodes"]
    assert summary["success_rate"] == pytest.approx(final["successes"] / final["episodes"])
    assert summary["steps_done"] == summary["config"]["steps"] and not summary["stopped_early"]
    assert summary["final_loss"] > 0 and summary["final_loss"] == summary["final_loss"]  # finite, not NaN
    assert summary["stream"]["successful_episodes"] >= summary["config"]["buffer_size"]
    assert summary["stream"]["completed_generation"] >= 1
    assert summary["stream"]["trained_contexts"] == summary["steps_done"] * summary["config"]["batch_size"]
    assert summary["stream"]["sampled_chunks"] >= summary["stream"]["trained_contexts"]
    # rates over the whole of training, however short it was
    steps, batch, span = summary["steps_done"], summary["config"]["batch_size"], summary["train_time_s"]
    assert summary["stream"]["mean_samples_per_s"] == pytest.approx(steps * batch / span)
    assert summary["stream"]["mean_fresh_episodes_per_s"] >= 0
    assert [e["step"] for e in summary["evals_during_training"]] == [75, 150]
    assert summary["total_time_s"] > 0

    report = (quick_run / "report.md").read_text()
    assert f"({final['successes']}/{final['episodes']} episodes)" in report
    assert "![overview](overview.png)" in report
    stream = summary["stream"]
    assert f"training steps | {stream['sampled_chunks']} / {stream['trained_contexts']} (" in report


def test_eval_reproduces_the_demo_result_and_writes_a_gif(quick_run, tmp_path, capsys):
    video, out = tmp_path / "rollouts.gif", tmp_path / "eval.json"
    checkpoint = str(quick_run / "checkpoint.pt")
    argv = ["eval", checkpoint, "--episodes", "4", "--video", str(video), "--video-episodes", "1"]
    assert simstream([*argv, "--image-size", "48", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    demo = json.loads((quick_run / "summary.json").read_text())["final_eval"]
    assert result["successes"] == demo["successes"]  # same seeds, same policy, same episodes
    assert video.read_bytes()[:6] in (b"GIF87a", b"GIF89a")
    frames = iio.imread(video)  # the state before each action, then the one the episode ended in
    assert frames.shape[:3] == (result["episode_length"][0] + 1, 48, 48)
    assert "success" in capsys.readouterr().out


def test_eval_refuses_a_video_that_would_not_fit_in_memory_before_evaluating(quick_run, tmp_path, capsys):
    """Every frame of the recorded episodes is kept, then stacked: 4 episodes at --image-size 256 took
    2.2 GB, and at 2048 a few episodes ran out of memory after the whole evaluation."""
    video = tmp_path / "v.gif"
    argv = ["eval", str(quick_run / "checkpoint.pt"), "--episodes", "4000", "--video", str(video)]
    assert simstream([*argv, "--video-episodes", "4000", "--image-size", "2048"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert (
        "EvalArgs.video: 4000 episode(s) of up to " in err and " frames of 2048 x 2048 pixels needs " in err
    )
    assert "--video-episodes can be at most " in err and "(or lower --image-size)" in err
    assert not video.exists()


def test_an_interrupted_write_leaves_no_file_or_the_one_it_replaced(tmp_path):
    from simstream._files import write_whole

    def cut_short(partial):
        partial.write_bytes(b"GIF89a half of a video")
        raise KeyboardInterrupt

    path = tmp_path / "rollouts.gif"
    with pytest.raises(KeyboardInterrupt):
        write_whole(path, cut_short)
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"the earlier video")
    with pytest.raises(KeyboardInterrupt):
        write_whole(path, cut_short)
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"the earlier video"
    write_whole(path, lambda partial: partial.write_bytes(b"a whole video"))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"a whole video"


@pytest.mark.parametrize(("options", "threshold"), [([], 0.25), (["--gripper-threshold", "0.7"], 0.7),
                                                   (["--continuous-gripper"], None)])  # fmt: skip
def test_eval_overrides_the_checkpoints_gripper_threshold(quick_run, tmp_path, options, threshold):
    out = tmp_path / "eval.json"
    argv = ["eval", str(quick_run / "checkpoint.pt"), "--episodes", "1", "--json-out", str(out), *options]
    assert simstream(argv) == 0
    assert json.loads(out.read_text())["rollout"]["gripper_threshold"] == threshold


def test_eval_rejects_a_missing_checkpoint_with_exit_code_2(tmp_path, capsys):
    assert simstream(["eval", str(tmp_path / "nope.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert simstream(["eval", str(tmp_path)]) == 2  # a run folder instead of its checkpoint
    assert f"checkpoint '{tmp_path}' is a folder; give the file in it (checkpoint.pt)" in _one_line(
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--steps", "0"], "DemoConfig.steps must be an int >= 1, got 0"),
        (["--seed", str(2**63)], f"DemoConfig.seed must be an int in [0, {2**63 - 1}], got {2**63}"),
        (["--max-episode-steps", "50"], "DemoConfig.max_episode_steps must be an int >= 100, got 50"),
        (["--horizon", "500"], "DemoConfig.horizon must be an int in [1, 200], got 500"),
        (["--history", "201"], "DemoConfig.history must be an int in [1, 200], got 201"),
        (  # accepted, ignored, and recorded in summary.json as applied
            ["--execute-steps", "3"],
            "DemoConfig.execute_steps must be 8 (its default) with temporal ensembling (ensemble_decay=0.0), "
            "which executes one action of every chunk, got 3. Add --ensemble-decay None",
        ),
        (
            ["--ray-address", "auto"],
            "DemoConfig.ray_address must be None unless backend is 'ray', got 'auto'",
        ),
        (["--backend", "ray", "--ray-address", " "], "DemoConfig.ray_address must be None or a nonempty"),
        # the engine's checks, before a run folder exists: a buffer /dev/shm cannot hold, a missing dataset
        pytest.param(
            ["--vision", "--image-size", "256", "--buffer-size", "4000"],
            "OnlineDataEngineCfg.buffer_size=4000 needs 314792394752 bytes (293.2 GiB) of shared memory",
            marks=pytest.mark.skipif(
                (free_shared_bytes() or 0) >= 314_816_225_280, reason="/dev/shm holds this buffer here"
            ),
        ),
        (["--dataset", "/nonexistent/simstream-dataset"], "no such dataset folder"),
        (
            ["--batch-size", "100000000"],
            "DemoConfig.batch_size=100000000 needs ",
        ),  # refused once training ran
        (
            ["--record", "/proc/simstream-dataset"],
            "DemoConfig.record cannot be written: '/proc/simstream-dataset' "
            "(creating a folder in '/proc' failed",
        ),
    ],
)
def test_demo_rejects_a_bad_option_with_exit_code_2_and_writes_nothing(options, message, tmp_path, capsys):
    assert simstream(["demo", "--quick", "--runs-dir", str(tmp_path / "runs"), *options]) == 2
    assert message in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_demo_refuses_to_record_into_a_folder_holding_other_files(tmp_path, capsys):
    """``simstream record`` refused such a folder; ``demo --record`` wrote its dataset beside the files."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert simstream(["demo", "--quick", "--runs-dir", str(tmp_path / "runs"), "--record", str(taken)]) == 2
    assert f"DemoConfig.record: {taken} exists and is not a LeRobot dataset" in _one_line(
        capsys.readouterr().err
    )
    assert sorted(p.name for p in taken.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("argv", "vision", "quick"),
    [
        (["--vision"], True, False),
        (["--vision", "--no-vision"], False, False),
        (["--no-vision", "--vision", "--quick"], True, True),
        (["--quick", "--no-quick"], False, False),
    ],
)
def test_the_last_of_a_switch_and_its_negation_decides_the_preset(argv, vision, quick):
    """``--vision --no-vision`` ran a state policy with every vision default (an EMA of 0.9995 and more)."""
    from simstream.bc import DemoConfig
    from simstream.cli.demo import parse_demo_args

    cfg = parse_demo_args(argv)
    expected = DemoConfig().with_vision() if vision else DemoConfig()
    expected = expected.with_quick() if quick else expected
    assert cfg == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--execute-steps", "0"], "EvalArgs.execute_steps must be an int >= 1, got 0"),
        (["--image-size", "20000"], "EvalArgs.image_size must be an int in [16, 2048], got 20000"),
        (
            ["--gripper-threshold", "1.5"],
            "EvalArgs.gripper_threshold must be None or a number in (0, 1), got 1.5",
        ),
        (
            ["--gripper-threshold", "0.4", "--continuous-gripper"],
            "EvalArgs.continuous_gripper must be False when gripper_threshold is given (they contradict)",
        ),
        (["--ensemble-decay", "-1"], "EvalArgs.ensemble_decay must be None or a finite number >= 0, got -1"),
        (["--video", "v.mp4", "--image-size", "33"], "EvalArgs.image_size must be even for an .mp4 video"),
        # accepted and ignored, and recorded by --json-out as applied
        (
            ["--fps", "5"],
            "EvalArgs.fps must be 20 (its default) without --video: it applies to the video only",
        ),
        (["--image-size", "32"], "EvalArgs.image_size must be 160 (its default) without --video"),
        (["--video-episodes", "3"], "EvalArgs.video_episodes must be 2 (its default) without --video"),
        (
            ["--execute-steps", "4", "--ensemble-decay", "0.1"],
            "EvalArgs.execute_steps must be None with --ensemble-decay (temporal ensembling executes one "
            "action of every chunk), got 4",
        ),
        (  # GIF delays are whole hundredths of a second: 30 fps played at 33, 60 at about 10
            ["--video", "v.gif", "--fps", "30"],
            "EvalArgs.fps must be one of 1, 2, 4, 5, 10, 20, 25, 50 for a .gif",
        ),
        (["--video", "v.gif", "--fps", "100"], "EvalArgs.fps must be one of 1, 2, 4, 5, 10, 20, 25, 50"),
        (["--video", "{file}/v.gif"], "EvalArgs.video cannot be written: '{file}' is a file, not a folder"),
        (["--json-out", "{file}/r.json"], "EvalArgs.json_out cannot be written: '{file}' is a file"),
        (  # known before the evaluation, whose results would be lost
            ["--json-out", "/proc/simstream/r.json"],
            "EvalArgs.json_out cannot be written: '/proc/simstream/r.json' "
            "(creating a folder in '/proc' failed",
        ),
    ],
)
def test_eval_rejects_a_bad_option_with_exit_code_2(options, message, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    options = [option.replace("{file}", str(blocker)) for option in options]
    assert simstream(["eval", str(tmp_path / "checkpoint.pt"), *options]) == 2
    assert message.replace("{file}", str(blocker)) in _one_line(capsys.readouterr().err)


def test_eval_refuses_more_executed_steps_than_the_policy_predicts(quick_run, capsys):
    argv = ["eval", str(quick_run / "checkpoint.pt"), "--episodes", "1", "--execute-steps", "100"]
    assert simstream(argv) == 2
    assert "EvalArgs.execute_steps must be <= the policy's horizon" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--buffer-size", "0"], "OnlineDataEngineCfg.buffer_size must be an int >= 1, got 0"),
        (  # it named num_envs, which stream has no option for
            ["--buffer-size", "1"],
            "OnlineDataEngineCfg.buffer_size must be >= the source's num_envs 4 "
            "(the rows one rollout writes), got 1",
        ),
        (["--num-workers", "0"], "OnlineDataEngineCfg.num_workers must be an int in [1, 1024], got 0"),
        (["--seconds", "nan"], "StreamArgs.seconds must be a number in (0, 1e6], got nan"),
        (["--batch-size", "0"], "StreamArgs.batch_size must be an int >= 1, got 0"),
        (
            ["--chunk-size", "500"],
            "StreamArgs.chunk_size must be <= the source's shortest episode 60, got 500",
        ),
        (  # longer than some episodes: it failed, or not, at a random sample_batch
            ["--chunk-size", "61"],
            "StreamArgs.chunk_size must be <= the source's shortest episode 60, got 61",
        ),
        (["--task", "nosuch"], "nosuch"),
        (
            ["--num-workers", "100000"],
            "OnlineDataEngineCfg.num_workers must be an int in [1, 1024], got 100000",
        ),
        (  # refused before the producers start, not by the first sample_batch
            ["--batch-size", "100000000"],
            "StreamArgs.batch_size=100000000 with chunk_size=16 needs",
        ),
        (
            ["--ray-address", "auto"],
            "StreamArgs.ray_address must be None unless backend is 'ray', got 'auto'",
        ),
    ],
)
def test_stream_rejects_a_bad_option_with_exit_code_2(options, message, capsys):
    assert simstream(["stream", "--seconds", "1", *options]) == 2
    out, err = capsys.readouterr()
    assert message in _one_line(err) and "Traceback" not in err
    assert out == ""  # refused before it says it starts anything


@pytest.mark.parametrize("frames", ["4", "1000000000"])  # more than an episode has: each of its frames once
def test_inspect_prints_segments_and_writes_a_frame_strip(tmp_path, capsys, monkeypatch, frames):
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # its monitor thread would outlive the test
    strip = tmp_path / "strip.png"
    argv = ["inspect", "--episodes", "2", "--show", "1", "--frames", frames, "--image-size", "48"]
    assert simstream([*argv, "--out", str(strip)]) == 0
    assert strip.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "pick up the" in out and "reach the" in out and "place the" in out
    assert "expert: 2/2 successful" in out and "episodes/s" in out


# ---------------------------------------------------------------------------------------------- Ctrl-C
_TRAINING_STEPS = re.compile(rb"training:[^\r\n]*?\| *(\d+)/100000")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_ctrl_c_stops_the_demo_and_leaves_nothing_running(tmp_path):
    # A shell that runs a job in the background makes it ignore SIGINT, and an ignored SIGINT is
    # inherited by every process the job starts. Install a handler while starting the demo, so that it
    # gets Python's usual Ctrl-C, as from a terminal, however this suite was started.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "simstream", "demo", "--quick", "--steps", "100000", "--time-limit-s",
             "600", "--runs-dir", str(tmp_path), "--name", "interrupted"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    lines: list[bytes] = []
    errors = bytearray()
    started, training = threading.Event(), threading.Event()

    def read_stdout() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(b"training started"):
                started.set()

    def read_stderr() -> None:  # tqdm's bar: "training: ... | 12/100000 [...]", updated with "\r"
        while chunk := process.stderr.read1(1 << 16):
            errors.extend(chunk)
            if not training.is_set() and any(
                int(steps) >= 10 for steps in _TRAINING_STEPS.findall(bytes(errors[-4096:]))
            ):
                training.set()

    readers = [threading.Thread(target=fn, daemon=True) for fn in (read_stdout, read_stderr)]
    for reader in readers:
        reader.start()
    try:
        assert started.wait(120), f"the demo never said 'training started': {lines}"
        # Ctrl-C lands mid-training, while producers are refilling the buffer
        assert training.wait(120), f"no training progress reported: {bytes(errors[-2000:])!r}"
        children = descendants(process.pid)
        assert children, "the demo should run producer processes"
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        for reader in readers:
            reader.join(timeout=10)
    text = errors.decode(errors="replace")
    assert code == 130, text[-2000:]
    wait_for_exit(children, 15, "processes left running after Ctrl-C")
    assert "interrupted" in text


def test_sigterm_stops_a_command_as_ctrl_c_does(tmp_path):
    """SIGTERM (``kill``, a scheduler's time limit) took the default action: no clean stop, a warning about
    leaked semaphores. Now it exits 143 after the command's own stop."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the Ctrl-C test above
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "simstream", "stream", "--seconds", "120"], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        for line in process.stdout:
            if line.startswith(b"first generation"):
                break
        children = descendants(process.pid)
        assert children, "stream should run producer processes"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    text = err.decode(errors="replace")
    assert process.returncode == 143, text[-2000:]
    assert "simstream stream: terminated (SIGTERM); the producers are stopped" in text
    assert "leaked" not in text and "Traceback" not in text
    wait_for_exit(children, 15, "processes left running after SIGTERM")


def _tiny_demo(runs: Path, name: str, *extra: str) -> list[str]:
    return [
        "demo", "--quick", "--steps", "4", "--eval-episodes", "1", "--eval-episodes-during", "0",
        "--buffer-size", "2", "--num-workers", "1", "--runs-dir", str(runs), "--name", name, *extra,
    ]  # fmt: skip


def test_the_trained_policy_is_saved_before_the_final_evaluation(tmp_path, monkeypatch):
    """The final evaluation takes minutes with cameras: interrupting it must not lose the training."""
    import tqdm

    import simstream.bc.demo as demo
    from simstream.bc import load_checkpoint

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)

    def interrupted(checkpoint, episodes):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_final_eval", interrupted)
    assert simstream(_tiny_demo(tmp_path, "cut")) == 130
    checkpoint = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert checkpoint.info == {"steps": 4, "success_rate": None, "run": "cut"}


def test_a_producer_failure_still_closes_the_recorder(tmp_path, monkeypatch):
    """engine.stop() raises the producer's failure; the recorder is closed anyway (threads ended, every
    episode published before the stop flushed)."""
    import tqdm

    from simstream import OnlineDataEngine
    from simstream.lerobot.dataset import read_dataset_meta

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    stop = OnlineDataEngine.stop

    def failing_stop(self, *args, **kwargs):
        stop(self, *args, **kwargs)
        raise RuntimeError("a producer failed")

    monkeypatch.setattr(OnlineDataEngine, "stop", failing_stop)
    before = set(threading.enumerate())
    assert simstream(_tiny_demo(tmp_path, "rec", "--record", str(tmp_path / "ds"))) == 1
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("lerobot")]
    assert len(read_dataset_meta(tmp_path / "ds").episodes) >= 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "--out", "strip"], "InspectArgs.out must be a .png or .jpg file, got 'strip'"),
        (
            ["inspect", "--image-size", "4096"],
            "InspectArgs.image_size must be an int in [16, 2048], got 4096",
        ),
        (
            ["inspect", "--out", "/proc/simstream/strip.png"],
            "InspectArgs.out cannot be written: '/proc/simstream/strip.png' "
            "(creating a folder in '/proc' failed",
        ),
    ],
)
def test_inspect_rejects_a_bad_option_with_exit_code_2(args, message, capsys):
    assert simstream(args) == 2
    assert message in _one_line(capsys.readouterr().err)


def test_inspect_checks_its_default_strip_path_before_recording(tmp_path, monkeypatch, capsys):
    """With ``runs`` a file, the episodes were recorded first and a FileExistsError ended the command."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("not a folder")
    assert simstream(["inspect", "--episodes", "2"]) == 2
    assert "InspectArgs.out cannot be written: 'runs' is a file, not a folder" in _one_line(
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_size": 0}, "SyntheticSpec.image_size must be an int in [1, 4096], got 0"),
        ({"image_size": True}, "SyntheticSpec.image_size must be an int in [1, 4096], got True"),
        (
            {"work_us_per_step": float("inf")},
            "SyntheticSpec.work_us_per_step must be a number in [0, 1e6], got inf",
        ),
        ({"work_us_per_step": -1}, "SyntheticSpec.work_us_per_step must be a number in [0, 1e6], got -1"),
        ({"state_dim": 4}, "SyntheticSpec.qpos_dim must be an int in [1, 4], got 14"),
        ({"action_dim": 65}, "SyntheticSpec.action_dim must be an int in [1, 64], got 65"),
    ],
)
def test_synthetic_spec_names_a_bad_setting(kwargs, message):
    from simstream.synthetic import SyntheticSpec

    with pytest.raises(ValueError) as raised:
        SyntheticSpec(**kwargs)
    assert str(raised.value) == message


def test_a_slow_synthetic_rollout_still_stops_when_asked():
    """Its burnt CPU (here a second per frame) looks at should_stop between slices of 10 ms."""
    from tensordict import TensorDict

    from simstream.synthetic import SyntheticSpec

    spec = SyntheticSpec(num_envs=1, max_episode_steps=4, min_length=4, num_segments=1, work_us_per_step=1e6)
    rows = TensorDict(
        {name.split("/")[0]: {} for name in spec.fields() if "/" in name}, batch_size=[1, 4]
    )  # fmt: skip
    for name, field in spec.fields().items():
        rows[tuple(name.split("/"))] = torch.zeros((1, 4, *field.shape), dtype=field.dtype)
    looks = []

    def should_stop() -> bool:  # false before the row, true from the first look during its burn
        looks.append(1)
        return len(looks) > 1

    assert spec.build(0, 0).rollout(rows, attempt=0, should_stop=should_stop) is None
    assert len(looks) == 2


def test_eval_refuses_a_json_out_folder_before_evaluating(tmp_path, capsys):
    assert simstream(["eval", str(tmp_path / "checkpoint.pt"), "--json-out", str(tmp_path)]) == 2
    assert f"EvalArgs.json_out must be a file, got {str(tmp_path)!r}" in _one_line(capsys.readouterr().err)


def test_demo_refuses_to_record_into_a_file_and_writes_nothing(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("not a dataset")
    runs = tmp_path / "runs"
    assert simstream(["demo", "--quick", "--runs-dir", str(runs), "--record", str(target)]) == 2
    assert "DemoConfig.record must be a dataset folder (new or to append to), got the file" in _one_line(
        capsys.readouterr().err
    )
    assert not runs.exists()


_FORKSERVER_SPY = """
import signal, threading
from multiprocessing import forkserver

first = []
real = forkserver.ensure_running


def spy():
    if not first:
        on_main = threading.current_thread() is threading.main_thread()
        blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # inherited by the forkserver
        first.append((on_main, blocked))
    real()


forkserver.ensure_running = spy
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.bc.demo import start_with_progress
from simstream.synthetic import SyntheticSpec

if __name__ == "__main__":
    engine = OnlineDataEngine(OnlineDataEngineCfg(source=SyntheticSpec(), buffer_size=4))
    try:
        start_with_progress(engine, 4, 120.0)
    finally:
        engine.stop()
    print(first)
"""


def test_the_demo_starts_the_forkserver_on_the_main_thread_with_ctrl_c_held(tmp_path):
    """The demo's engine starts on a helper thread (behind a progress bar), where the forkserver started
    with Python's Ctrl-C handler: a terminal's Ctrl-C during its preload printed its traceback, or broke a
    producer's imports mid-way and ended the demo with a misleading error and exit 1. It starts on the main
    thread with SIGINT blocked (the forkserver inherits the mask; the owner delivers a held Ctrl-C after)."""
    script = tmp_path / "spy.py"
    script.write_text(_FORKSERVER_SPY)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[(True, True)]"
