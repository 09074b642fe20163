"""``simstream record`` end to end, and ``demo --record`` then ``demo --dataset`` in the quick mode."""

from __future__ import annotations

import json

import pytest

from simstream.cli.main import main as simstream
from simstream.lerobot import LeRobotRecorder, LeRobotSpec
from simstream.lerobot.dataset import read_dataset_meta

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def no_tqdm_monitor(monkeypatch):
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no tqdm monitor thread outliving the test


# the smallest demo that still runs every stage
TINY_DEMO = [
    "--quick",
    "--steps",
    "10",
    "--eval-every",
    "10",
    "--eval-episodes",
    "1",
    "--eval-episodes-during",
    "0",
]


def test_record_writes_a_dataset_and_says_where(tmp_path, capsys):
    out = tmp_path / "pick"
    args = ["record", "--task", "pick_place", "--episodes", "3", "--out", str(out), "--num-workers", "1"]
    assert simstream([*args, "--buffer-size", "2", "--image-size", "32", "--no-video"]) == 0
    printed = capsys.readouterr().out
    assert f"dataset: {out.resolve()} (3 episodes, LeRobot v3.0)" in printed
    assert "recorded 3 episodes" in printed
    meta = read_dataset_meta(out)
    assert meta.info["total_episodes"] == 3 and meta.info["fps"] == 20
    assert meta.info["features"]["observation.image"]["dtype"] == "image"
    assert all(ep["success"] for ep in meta.episodes)
    spec = LeRobotSpec(out)
    assert sorted(spec.fields()) == ["actions", "obs/image", "obs/objects", "obs/state", "rewards"]
    # appending: a second run adds to the same dataset
    assert (
        simstream([*args, "--buffer-size", "2", "--image-size", "32", "--no-video", "--episodes", "1"]) == 0
    )
    assert "(4 episodes, LeRobot v3.0)" in capsys.readouterr().out


def test_record_without_out_writes_datasets_named_after_the_task(tmp_path, monkeypatch, capsys):
    """The default was datasets/pick_place whatever the task: stack episodes went into pick_place's."""
    monkeypatch.chdir(tmp_path)
    args = ["record", "--task", "stack", "--episodes", "1", "--num-workers", "1", "--buffer-size", "2"]
    assert simstream(args) == 0
    out = tmp_path / "datasets" / "stack"
    assert f"dataset: {out} (1 episodes, LeRobot v3.0)" in capsys.readouterr().out
    assert read_dataset_meta(out).info["total_episodes"] == 1
    assert not (tmp_path / "datasets" / "pick_place").exists()


def test_record_encodes_cameras_as_h264_video_by_default(tmp_path):
    out = tmp_path / "video"
    args = ["record", "--task", "pick_place", "--episodes", "2", "--out", str(out), "--num-workers", "1"]
    assert simstream([*args, "--buffer-size", "2", "--image-size", "32"]) == 0
    feature = read_dataset_meta(out).info["features"]["observation.image"]
    assert feature["dtype"] == "video" and feature["info"]["video.codec"] == "h264"
    assert feature["info"]["video.preset"] == "ultrafast"
    assert simstream([*args, "--buffer-size", "2", "--image-size", "32", "--video-codec", "vp9"]) == 2


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--episodes", "0"], "RecordArgs.episodes must be an int >= 1, got 0"),
        (["--num-workers", "0"], "RecordArgs.num_workers must be an int in [1, 256], got 0"),
        (["--buffer-size", "0"], "RecordArgs.buffer_size must be an int >= 2, got 0"),
        (["--max-episode-steps", "30"], "RecordArgs.max_episode_steps must be an int >= 100, got 30"),
        (["--seed", "-1"], "RecordArgs.seed must be an int in [0, 9223372036854775807], got -1"),
        (["--key-map", "action"], "--key-map items must read LEROBOT_KEY=FIELD_NAME, got 'action'"),
        (
            ["--key-map", "observation.x=obs/nope"],
            r"key_map names field(s) ['obs/nope'] that the source does not",
        ),
        (["--task", "juggle"], "juggle"),
        (["--image-size", "0"], "RecordArgs.image_size must be an int in [8, 2048], got 0"),  # named none
        (
            ["--ray-address", "auto"],
            "RecordArgs.ray_address must be None unless backend is 'ray', got 'auto'",
        ),
        (["--backend", "ray", "--ray-address", "ray://head:10001"], "RecordArgs.ray_address"),
        (  # before any episode is recorded
            ["--out", "/proc/simstream-dataset"],
            "RecordArgs.out cannot be written: '/proc/simstream-dataset' "
            "(creating a folder in '/proc' failed",
        ),
    ],
)
def test_record_bad_options_exit_2(tmp_path, capsys, args, fragment):
    assert simstream(["record", "--out", str(tmp_path / "ds"), "--episodes", "1", *args]) == 2
    assert fragment in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "ds").exists()


def test_record_refuses_a_folder_that_is_not_a_dataset(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert simstream(["record", "--out", str(tmp_path), "--episodes", "1"]) == 2
    assert "exists and is not a LeRobot dataset" in capsys.readouterr().err


def test_demo_records_the_live_stream_then_trains_from_it(tmp_path, capsys):
    runs, dataset = tmp_path / "runs", tmp_path / "recorded"
    assert (
        simstream(["demo", *TINY_DEMO, "--runs-dir", str(runs), "--name", "rec", "--record", str(dataset)])
        == 0
    )
    summary = json.loads((runs / "rec" / "summary.json").read_text())
    meta = read_dataset_meta(dataset)
    # every episode the producers published while the demo ran, none dropped (the recorder never skips)
    assert len(meta.episodes) == summary["stream"]["successful_episodes"] == meta.info["total_episodes"]
    assert f"recording the live stream into {dataset}" in capsys.readouterr().out
    assert (
        simstream(
            ["demo", *TINY_DEMO, "--runs-dir", str(runs), "--name", "replay", "--dataset", str(dataset)]
        )
        == 0
    )
    replay = json.loads((runs / "replay" / "summary.json").read_text())
    assert replay["steps_done"] == 10 and replay["stream"]["successful_episodes"] >= 16
    assert f"replayed from the LeRobot dataset `{dataset}`" in (runs / "replay" / "report.md").read_text()
    assert "streamed live from MuJoCo" in (runs / "rec" / "report.md").read_text()


def test_run_record_reports_what_it_recorded_and_how_long_producers_waited(tmp_path):
    from simstream.cli.record import RecordArgs, run_record

    out = tmp_path / "ds"
    result = run_record(RecordArgs(episodes=3, out=out, num_workers=1, buffer_size=2), progress=False)
    assert result["episodes"] == 3 and result["total_episodes"] == 3
    assert result["path"] == str(out.resolve()) and result["bytes"] > 0
    assert result["skipped"] == 0 and result["filtered"] == 0
    # two rows for one producer: its claims wait for the recorder's copies, and that time is counted
    assert isinstance(result["producer_wait_s"], float) and result["producer_wait_s"] >= 0.0


def test_an_interrupted_record_says_how_many_episodes_it_kept_and_where(tmp_path, monkeypatch, capsys):
    """The interruption is forced once two episodes are flushed (a real Ctrl-C is timing-dependent)."""
    import simstream.lerobot as lerobot
    from simstream.cli import record

    recorders = []

    class Watched(lerobot.LeRobotRecorder):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs, flush_interval_s=0.05)
            recorders.append(self)

    real = record.refill_until

    def until_two_are_flushed(engine, done, tick):
        def tick_then_interrupt() -> None:
            tick()
            if recorders[0].episodes_flushed >= 2:
                raise KeyboardInterrupt

        return real(engine, done, tick_then_interrupt)

    monkeypatch.setattr(lerobot, "LeRobotRecorder", Watched)  # run_record imports it when it runs
    monkeypatch.setattr(record, "refill_until", until_two_are_flushed)
    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        record.run_record(record.RecordArgs(episodes=50, out=out, num_workers=1), progress=False)
    kept = len(read_dataset_meta(out).episodes)
    assert kept >= 2
    err = capsys.readouterr().err
    assert f"episodes of this run were flushed; the dataset {out.resolve()} holds {kept} episodes" in err


def test_demo_refuses_datasets_that_do_not_fit_before_making_a_run_folder(tmp_path, capsys):
    """A replayed dataset of another task, a recording target with other features, recording into the
    replayed dataset, and a run folder that already holds a run: each exits 2 naming the setting."""
    stack = tmp_path / "stack"
    args = ["record", "--task", "stack", "--episodes", "1", "--out", str(stack), "--num-workers", "1"]
    assert simstream([*args, "--buffer-size", "1", "--image-size", "32", "--no-video"]) == 0
    capsys.readouterr()
    runs = tmp_path / "runs"

    def refused(*options: str) -> str:
        assert simstream(["demo", *TINY_DEMO, "--runs-dir", str(runs), *options]) == 2
        assert not runs.exists()
        return " ".join(capsys.readouterr().err.split())

    message = refused("--dataset", str(stack))
    assert f"DemoConfig.dataset: {stack} holds episodes that task 'pick_place' never produces" in message
    assert message.endswith("; pass --task stack")
    message = refused("--record", str(stack))
    assert f"{stack}/meta/info.json: the dataset's features do not match the recording's (" in message
    message = refused("--task", "stack", "--dataset", str(stack), "--record", str(stack))
    assert "DemoConfig.record must not be the dataset the demo replays" in message
    # rows as long as the dataset's one episode, shorter than max_episode_steps (200): it failed once the
    # producers ran, naming the engine's prediction_horizon
    frames = read_dataset_meta(stack).episodes[0]["length"]
    message = refused("--task", "stack", "--dataset", str(stack), "--horizon", "200")
    longest = f"at most {frames}, the frames of the longest episode of the dataset, got 200"
    assert f"DemoConfig.horizon must be {longest}" in message
    (runs / "taken").mkdir(parents=True)
    (runs / "taken" / "report.md").write_text("an earlier run")
    assert simstream(["demo", *TINY_DEMO, "--runs-dir", str(runs), "--name", "taken"]) == 2
    assert f"DemoConfig.name: {str(runs / 'taken')!r} already holds a run" in capsys.readouterr().err
    runs_file = tmp_path / "runs.txt"
    runs_file.write_text("not a folder")
    assert simstream(["demo", *TINY_DEMO, "--runs-dir", str(runs_file)]) == 2
    assert f"DemoConfig.runs_dir must be a folder, got the file {str(runs_file)!r}" in capsys.readouterr().err


def test_a_failure_while_recording_is_a_failure_not_a_bad_option(tmp_path, monkeypatch, capsys):
    """Every ValueError of `simstream record` exited 2 as "a bad option", printed without its type, even
    one raised by the writer (or a producer) minutes into the recording."""
    from simstream.lerobot import writer

    def broken(self) -> int:
        raise ValueError("the disk said no")

    monkeypatch.setattr(writer.DatasetWriter, "flush", broken)
    argv = ["record", "--out", str(tmp_path / "ds"), "--episodes", "2", "--num-workers", "1"]
    assert simstream([*argv, "--buffer-size", "2"]) == 1
    assert "simstream record: ValueError: the disk said no" in capsys.readouterr().err
    assert simstream(["record", "--out", str(tmp_path / "ds2"), "--episodes", "0"]) == 2  # still a bad option
    assert "RecordArgs.episodes must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "episodes", "message", "kept"),
    [
        ({"fail_after": 6}, 50, "RuntimeError: pattern source failed after 6 episodes", 6),
        ({"close_fails": True}, 4, "OSError: the pattern source could not flush while closing", 4),
    ],
    ids=["producer-raises", "source-close-raises"],
)
def test_a_failure_while_recording_still_closes_the_recorder_with_every_episode_published(
    tmp_path, monkeypatch, capsys, spec, episodes, message, kept
):
    """A stop() that raised (a source's close() failed) skipped the recorder's close(): its threads
    (daemons) were left running, and a process that then exited lost the episodes they had not flushed."""
    import threading

    import simstream.tasks as tasks

    from .sources import PatternSpec

    monkeypatch.setattr(tasks, "make_source", lambda *args, **kwargs: PatternSpec(**spec))
    closed, close = [], LeRobotRecorder.close

    def watched_close(self, *args, **kwargs) -> None:
        closed.append(self)
        close(self, *args, **kwargs)

    monkeypatch.setattr(LeRobotRecorder, "close", watched_close)
    out = tmp_path / "ds"
    argv = [
        "record",
        "--out",
        str(out),
        "--episodes",
        str(episodes),
        "--num-workers",
        "1",
        "--buffer-size",
        "8",
    ]
    assert simstream(argv) == 1
    assert f"simstream record: {message}" in capsys.readouterr().err
    assert len(closed) == 1  # closed, not left writing in daemon threads that die with the process
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lerobot-")]
    assert len(read_dataset_meta(out).episodes) == kept  # every episode published (8 rows: none overwritten)
    assert len(LeRobotSpec(out).build(0, 0).reader.read(kept - 1).frames["obs/state"]) == 12 + (kept - 1) % 7
