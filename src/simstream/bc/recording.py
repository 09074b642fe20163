"""The demo and LeRobot datasets: ``--record DIR`` records the live stream, ``--dataset DIR`` replays one.

Recording runs beside training: a :class:`~simstream.lerobot.LeRobotRecorder` thread copies every episode
the producers publish (producers wait for it if it falls behind; the trainer never does). Replaying builds
a :class:`~simstream.lerobot.LeRobotSpec` holding the fields the live source would have had, so the same
engine, sampler and policy train from it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TRAINING_FLUSH_EVERY",
    "check_dataset_task",
    "check_record_target",
    "demo_recorder",
    "demo_source",
]

TRAINING_FLUSH_EVERY = 8
"""Episodes per group of files when recording beside training (``demo --record``). Smaller than the
recorder's default of 32, which suits a recording-only process (``simstream record``: less CPU per
episode, fewer files). Beside a trainer, ``sample_batch`` kept 0.83-0.93 of its rate with groups of 8
(median 0.90 over three runs) and 0.82-0.85 with groups of 32 (three runs): the runs overlap, but
shorter bursts of writing never measured worse (``BENCHMARKS.md``, recording runs 9-13)."""


def demo_source(cfg: Any, live_source: Any) -> Any:
    """``live_source``, or with ``cfg.dataset`` the dataset's episodes with the same field names, shapes
    and dtypes (a camera of another size would train the policy on one size and evaluate it on renders
    of another).

    Raises:
        ValueError: naming the dataset file that is wrong, the fields it lacks, or a field that differs
            (a camera: naming ``--image-size``).
    """
    if getattr(cfg, "dataset", None) is None:
        return live_source
    from simstream.lerobot import LeRobotSpec

    replay = LeRobotSpec(cfg.dataset, fields_subset=tuple(live_source.fields()))
    stored, live = replay.fields(), live_source.fields()
    for name, field in live.items():
        if (stored[name].shape, stored[name].dtype) == (field.shape, field.dtype):
            continue
        if len(field.shape) == 3 and field.dtype is stored[name].dtype and hasattr(cfg, "image_size"):
            # the policy would train on the dataset's size and be evaluated on renders of this size
            height, width = stored[name].shape[1:]
            fix = f"pass --image-size {height}" if height == width else "the demo renders square cameras"
            raise ValueError(
                f"DemoConfig.image_size is {cfg.image_size}, but the camera {name!r} of the dataset "
                f"{replay.root} is {height}x{width}: {fix}"
            )
        raise ValueError(
            f"DemoConfig.dataset: the field {name!r} of {replay.root} is {stored[name].dtype} "
            f"{tuple(stored[name].shape)}; the live task's is {field.dtype} {tuple(field.shape)}"
        )
    return replay


def demo_recorder(engine: Any, cfg: Any) -> Any:
    """With ``cfg.record``, a started recorder of ``engine``'s published episodes (close it after stop)."""
    if getattr(cfg, "record", None) is None:
        return None
    from simstream.lerobot import LeRobotRecorder

    recorder = LeRobotRecorder(engine, cfg.record, flush_every=TRAINING_FLUSH_EVERY)
    print(f"recording the live stream into {recorder.root} (LeRobot v3.0)", flush=True)
    return recorder.start()


def check_dataset_task(source: Any, task: str) -> None:
    """A replayed dataset must hold episodes of ``task``: the demo evaluates and saves the policy as
    ``task``'s, so training it on another task's episodes would go unnoticed.

    Raises:
        ValueError: naming the dataset, a text that ``task`` never produces, and the built-in task whose
            texts the dataset's are, if any.
    """
    from simstream.lerobot.dataset import read_dataset_meta
    from simstream.tasks import list_tasks, task_instructions

    texts = set(read_dataset_meta(source.root).tasks)
    foreign = sorted(texts - set(task_instructions(task)))
    if not foreign:
        return
    matches = [name for name in list_tasks() if texts <= set(task_instructions(name))]
    hint = f"; pass --task {matches[0]}" if matches else ""
    raise ValueError(
        f"DemoConfig.dataset: {source.root} holds episodes that task {task!r} never produces, e.g. "
        f"{foreign[0]!r}{hint}"
    )


def check_record_target(source: Any, root: Any) -> None:
    """An existing dataset at ``root`` must take the demo's episodes (same features, fps, column kinds),
    checked before the run starts; a new folder needs nothing.

    Raises:
        ValueError: naming the dataset file and what does not match.
    """

    from simstream.lerobot.format import features_from_fields
    from simstream.lerobot.names import KeyMap
    from simstream.lerobot.writer import DatasetWriter, check_dataset_folder

    if not check_dataset_folder(root, "DemoConfig.record"):
        return
    features = features_from_fields(dict(source.fields()), KeyMap(None), True)
    DatasetWriter(root, features, source.fps).close()  # repairs an interrupted dataset, as the recorder would
