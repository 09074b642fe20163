"""End to end: ``simstream demo --vision --quick`` as a command (real producers rendering with MuJoCo), then
``simstream eval`` on its vision checkpoint, with a video of the front camera and the policy's cameras."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simstream.bc import load_checkpoint
from simstream.bc.report import PLOTS, STRIPS
from simstream.bc.vision import VisionPolicy
from simstream.cli.main import main as simstream

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory) -> Path:
    """One ``demo --vision --quick`` run in a child process, shared by the tests of this module."""
    runs = tmp_path_factory.mktemp("runs")
    argv = [sys.executable, "-m", "simstream", "demo", "--vision", "--quick", "--runs-dir", str(runs)]
    record = ["--record", str(runs / "vq_dataset")]  # the cameras' stream, for the replay test below
    done = subprocess.run([*argv, "--name", "vq", *record], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "closed-loop success on pick_place" in done.stdout
    return runs / "vq"


def test_vision_from_a_recorded_dataset_writes_its_strips_and_refuses_another_image_size(
    vision_run, tmp_path
):
    """A replayed vision run wrote no strips (they were tied to the live source's bare-rate measurement),
    and a dataset of 64x64 cameras trained a policy that --image-size 32 then evaluated on 32x32 renders."""
    dataset, runs = vision_run.parent / "vq_dataset", tmp_path / "runs"
    argv = [sys.executable, "-m", "simstream", "demo", "--vision", "--quick", "--runs-dir", str(runs)]
    wrong = subprocess.run(
        [*argv, "--dataset", str(dataset), "--image-size", "32"], capture_output=True, text=True, timeout=120
    )
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert (
        f"DemoConfig.image_size is 32, but the camera 'obs/images/front' of the dataset {dataset} is 64x64: "
        "pass --image-size 64" in " ".join(wrong.stderr.split())
    )
    assert not runs.exists()
    shorter = ["--steps", "10", "--eval-every", "10", "--eval-episodes", "1", "--eval-episodes-during", "0"]
    done = subprocess.run(
        [*argv, *shorter, "--name", "replay", "--dataset", str(dataset)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((runs / "replay" / "summary.json").read_text())
    assert "bare_source" not in summary["stream"]  # a dataset has no simulation to measure alone
    strips = [Path(path) for path in summary["strips"]]
    assert strips and all(path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for path in strips)
    assert f"replayed from the LeRobot dataset `{dataset}`" in (runs / "replay" / "report.md").read_text()


def test_vision_quick_writes_report_plots_strip_and_checkpoint(vision_run):
    for name in ("report.md", "summary.json", "training_log.json", "checkpoint.pt", *PLOTS):
        assert (vision_run / name).is_file() and (vision_run / name).stat().st_size > 0, name
    summary = json.loads((vision_run / "summary.json").read_text())
    cfg = summary["config"]
    assert summary["vision"] is True and summary["quick"] is True
    assert cfg["cameras"] == ["front", "wrist"] and cfg["image_size"] == 64
    assert summary["steps_done"] == cfg["steps"] == 60
    assert summary["final_eval"]["episodes"] == 4 and summary["final_loss"] == summary["final_loss"]
    assert 0.0 <= summary["batch_wait_share"] <= 1.0
    bare = summary["stream"]["bare_source"]
    assert bare["episodes_per_s"] > 0 and bare["render_ms_per_frame"] > 0 and 0 < bare["render_share"] <= 1
    # a strip per outcome the final evaluation had (4 quick episodes: usually failures only)
    strips = [Path(path) for path in summary["strips"]]
    assert strips and {path.name for path in strips} <= set(STRIPS.values())
    report = (vision_run / "report.md").read_text()
    for path in strips:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({path.name})" in report
    assert "waiting for a batch" in report and "vs the bare source" in report
    assert "the policy read the head's own estimate, made from pixels" in report
    assert "moving average of the weights (decay 0.9995)" in report
    assert "gripper command was executed fully open above 0.25 and closed below" in report
    checkpoint = load_checkpoint(vision_run / "checkpoint.pt")
    assert checkpoint.rollout.gripper_threshold == 0.25
    assert isinstance(checkpoint.policy, VisionPolicy)
    assert checkpoint.policy.config.cameras == ("front", "wrist")


def test_eval_of_a_vision_checkpoint_reproduces_it_and_records_both_views(
    vision_run, tmp_path, capsys, monkeypatch
):
    import imageio.v3 as iio
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no tqdm monitor thread outliving the test

    video, out = tmp_path / "rollouts.gif", tmp_path / "eval.json"
    argv = ["eval", str(vision_run / "checkpoint.pt"), "--episodes", "4", "--video", str(video)]
    assert simstream([*argv, "--video-episodes", "1", "--image-size", "48", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    demo = json.loads((vision_run / "summary.json").read_text())["final_eval"]
    assert result["policy"] == "vision" and result["successes"] == demo["successes"]
    frames = iio.imread(video)  # every frame: the state before each action, then the one it ended in
    assert frames.shape[:3] == (result["episode_length"][0] + 1, 48, 48 * 3)  # front, then the policy's views
    assert "success" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--image-size", "8"], "DemoConfig.image_size must be an int in [16, 256], got 8"),
        (["--cameras", "front", "nose"], "nose"),
        (["--device", "tpu"], "DemoConfig.device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ],
)
def test_demo_vision_rejects_a_bad_option_with_exit_code_2_and_writes_nothing(
    options, message, tmp_path, capsys
):
    assert simstream(["demo", "--vision", "--quick", "--runs-dir", str(tmp_path / "runs"), *options]) == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not (tmp_path / "runs").exists()
