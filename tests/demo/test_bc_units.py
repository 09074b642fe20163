"""Pure unit tests of the behaviour-cloning pieces: embedding, loss masking, policy, batches, checkpoint."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from simstream.bc import (
    ChunkPolicy,
    DemoConfig,
    HashedTextEmbedding,
    PolicyConfig,
    RolloutConfig,
    eval_seeds,
    evaluate_policy,
    load_checkpoint,
    masked_chunk_loss,
    observation_features,
    save_checkpoint,
)
from simstream.bc.checkpoint import PolicyCheckpoint
from simstream.bc.data import InstructionTable, context_batch
from simstream.bc.evaluate import _ChunkExecutor
from simstream.bc.policy import FEATURE_DIM, absolute_actions, relative_actions
from simstream.bc.text import tokenize
from simstream.tasks import list_tasks, task_instructions

pytestmark = pytest.mark.timeout(60)

RED = "pick up the red cube and place it in the bin"
BLUE = "pick up the blue cube and place it in the bin"


# ---------------------------------------------------------------------------------------- text embedding
def test_tokenize_lowercases_and_drops_punctuation():
    assert tokenize("Pick the RED cube, now!") == ["pick", "the", "red", "cube", "now"]


def test_embedding_is_unit_norm_and_tells_colours_apart():
    embed = HashedTextEmbedding(64)
    vectors = embed([RED, BLUE, RED])
    assert vectors.shape == (3, 64)
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(3))
    assert torch.equal(vectors[0], vectors[2])
    assert (vectors[0] - vectors[1]).abs().sum() > 0.5


def test_embedding_is_the_same_in_another_process():
    # str hashes are salted per process: the embedding must not depend on them
    code = (
        "from simstream.bc.text import HashedTextEmbedding; "
        f"print(HashedTextEmbedding(32).embed_one({RED!r}).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    other = torch.tensor(eval(out.stdout))
    torch.testing.assert_close(other, HashedTextEmbedding(32).embed_one(RED))


def test_embedding_settings_round_trip_and_validate():
    for ngram in (1, 2, 3):
        embed = HashedTextEmbedding(dim=48, ngram=ngram)
        again = HashedTextEmbedding.from_state_dict(embed.state_dict())
        assert torch.equal(again([RED]), embed([RED]))
    with pytest.raises(ValueError, match=r"HashedTextEmbedding\.dim must be an int >= 8, got 4"):
        HashedTextEmbedding(4)
    with pytest.raises(ValueError, match=r"HashedTextEmbedding\.ngram must be an int in \[1, 3\], got 4"):
        HashedTextEmbedding(64, ngram=4)


def test_a_pair_embedding_is_what_checkpoints_saved_before_triples_hold():
    """Words and adjacent pairs, as every checkpoint saved with ngram=2 was trained on."""
    from simstream.bc.text import _bucket

    words = ["stack", "the", "red", "cube"]
    features = [*words, "stack the", "the red", "red cube"]
    expected = torch.zeros(32)
    for feature in features:
        index, sign = _bucket(feature, 32)
        expected[index] += sign
    torch.testing.assert_close(
        HashedTextEmbedding(32, ngram=2).embed_one(" ".join(words)), expected / expected.norm()
    )


@pytest.mark.parametrize("task", list_tasks())
def test_every_instruction_of_every_task_embeds_apart_from_the_others(task):
    """With words and pairs only, "stack the red cube on the blue cube" and its swap embedded the same:
    a policy could not tell which cube goes on top."""
    texts = task_instructions(task, subtasks=True)
    vectors = HashedTextEmbedding(64)(list(texts))
    distances = torch.cdist(vectors, vectors) + torch.eye(len(texts)) * 10
    closest = int(distances.min(dim=1).values.argmin())
    assert float(distances.min()) > 0.1, (texts[closest], float(distances.min()))
    swapped = ("stack the red cube on the blue cube", "stack the blue cube on the red cube")
    assert not torch.equal(*HashedTextEmbedding(64)(list(swapped)))
    assert torch.equal(*HashedTextEmbedding(64, ngram=2)(list(swapped)))  # why pairs were not enough


# ---------------------------------------------------------------------------------------- loss masking
def test_loss_ignores_padded_targets_whatever_they_hold():
    prediction = torch.zeros(2, 3, 8)
    target = torch.ones(2, 3, 8)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    target[~mask] = float("nan")  # padding must not even reach the arithmetic
    loss = masked_chunk_loss(prediction, target, mask)
    assert loss.item() == pytest.approx(1.0)  # every valid step has squared error 1

    target = torch.zeros(2, 3, 8)
    target[0, 0] = 2.0  # error 4 on one of three valid steps
    target[~mask] = 1e6
    assert masked_chunk_loss(prediction, target, mask).item() == pytest.approx(4.0 / 3.0)


def test_loss_gradient_is_zero_on_padded_steps():
    prediction = torch.randn(1, 4, 8, requires_grad=True)
    mask = torch.tensor([[True, True, False, False]])
    masked_chunk_loss(prediction, torch.randn(1, 4, 8), mask).backward()
    assert prediction.grad[0, 2:].abs().max() == 0
    assert prediction.grad[0, :2].abs().max() > 0


def test_loss_of_an_all_padded_batch_is_zero_not_nan():
    loss = masked_chunk_loss(torch.ones(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0


# ---------------------------------------------------------------------------------------- policy
def test_features_append_cube_offsets_from_the_gripper():
    state, objects = torch.zeros(23), torch.zeros(21)
    state[16:19] = torch.tensor([0.1, 0.2, 0.3])
    objects[7:10] = torch.tensor([0.5, 0.5, 0.5])  # the second cube
    features = observation_features(state, objects)
    assert features.shape == (FEATURE_DIM,)
    torch.testing.assert_close(features[-6:-3], torch.tensor([0.4, 0.3, 0.2]))


def test_relative_and_absolute_actions_are_inverse():
    actions, anchor = torch.randn(4, 6, 8), torch.randn(4, 23)
    relative = relative_actions(actions, anchor)
    torch.testing.assert_close(relative[..., 7], actions[..., 7])  # gripper stays absolute
    torch.testing.assert_close(absolute_actions(relative, anchor), actions)


def test_policy_output_ignores_padded_history_frames():
    torch.manual_seed(0)
    policy = ChunkPolicy(PolicyConfig(history=3, horizon=5, hidden=32, layers=2, text_dim=16))
    features, text = torch.randn(2, 3, FEATURE_DIM), torch.randn(2, 16)
    mask = torch.tensor([[False, True, True], [True, True, True]])
    out = policy(features, mask, text)
    assert out.shape == (2, 5, 8)
    features[0, 0] = 1e3  # a padded frame: its content must not matter
    torch.testing.assert_close(policy(features, mask, text)[0], out[0])


def test_normalizer_uses_valid_frames_and_targets_only():
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=2, hidden=16, layers=1, text_dim=8))
    features = torch.ones(4, 2, FEATURE_DIM)
    valid = torch.tensor([[False, True]] * 4)
    features[:, 0] = 1e6  # invalid history frames
    targets = torch.ones(4, 2, 8)
    loss_mask = torch.tensor([[True, False]] * 4)
    targets[:, 1] = -1e6  # padded targets
    policy.fit_normalizer(features, valid, targets, loss_mask)
    torch.testing.assert_close(policy.feature_mean, torch.ones(FEATURE_DIM))
    torch.testing.assert_close(policy.target_mean[0], torch.ones(8))
    assert policy.target_std.min() >= 1e-3


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("history", 0, "in [1, 1024]"),
        ("horizon", 0, "in [1, 1024]"),
        ("history", 100_000, "in [1, 1024]"),  # accepted: a 5 GiB first layer before a weight was checked
        ("horizon", 1025, "in [1, 1024]"),
        ("history", True, "in [1, 1024]"),
        ("horizon", 4.0, "in [1, 1024]"),
        ("hidden", 2, "in [8, 8192]"),
        ("hidden", 10_000_000, "in [8, 8192]"),  # failed in the allocator after 30 s, a run folder made
        ("layers", 0, "in [1, 32]"),
        ("text_dim", 5000, "in [8, 4096]"),
    ],
)
def test_policy_config_names_the_bad_field(name, value, accepted):
    with pytest.raises(
        ValueError, match=re.escape(f"PolicyConfig.{name} must be an int {accepted}, got {value}")
    ):
        PolicyConfig(**{name: value})
    with pytest.raises(ValueError, match=re.escape(f"DemoConfig.{name} must be an int")):
        DemoConfig(**{name: value})


# ---------------------------------------------------------------------------------------- batches
class _Registry:
    texts = (RED, BLUE)

    def resolve(self, indices, *, kind="task"):
        assert kind == "task"
        return [self.texts[i] for i in indices.tolist()]


def test_context_batch_splits_history_and_targets_at_the_anchor():
    history, width = 2, 4  # horizon F = 3: width = H + F - 1
    state = torch.arange(2 * width, dtype=torch.float32).view(2, width, 1).expand(2, width, 23).clone()
    valid = torch.tensor([[False, True, True, True], [True, True, True, False]])
    batch = TensorDict(
        {
            "obs": {"state": state * valid[..., None], "objects": torch.zeros(2, width, 21)},
            "actions": torch.full((2, width, 8), 10.0) * valid[..., None],
            "valid": valid,
            "loss_mask": valid & (torch.arange(width) >= history - 1),
            "task_index": torch.tensor([[-1, 1, 1, 1], [0, 0, 0, -1]]),
        },
        batch_size=[2, width],
    )
    data = context_batch(batch, history, InstructionTable(_Registry(), HashedTextEmbedding(16)))
    assert data.features.shape == (2, history, FEATURE_DIM)
    assert data.history_mask.tolist() == [[False, True], [True, True]]
    assert data.loss_mask.tolist() == [[True, True, True], [True, True, False]]
    # joints relative to the anchor state (index 1): anchor values 1 and 5
    assert data.targets[0, :, 0].tolist() == [9.0, 9.0, 9.0]
    assert data.targets[1, :2, 0].tolist() == [5.0, 5.0]
    torch.testing.assert_close(data.text, HashedTextEmbedding(16)([BLUE, RED]))


# ---------------------------------------------------------------------------------------- execution
def test_receding_horizon_plays_the_first_steps_then_asks_again():
    executor = _ChunkExecutor(1, 4, RolloutConfig(ensemble_decay=None, execute_steps=2))
    chunk = torch.arange(4.0)[:, None].expand(4, 8).numpy()
    assert executor.needs_plan(0)
    executor.add_plan(0, chunk)
    assert executor.pop(0)[0] == 0 and not executor.needs_plan(0)
    assert executor.pop(0)[0] == 1 and executor.needs_plan(0)


def test_temporal_ensembling_blends_overlapping_chunks():
    executor = _ChunkExecutor(1, 3, RolloutConfig(ensemble_decay=0.0))
    executor.add_plan(0, torch.zeros(3, 8).numpy())
    assert executor.pop(0)[0] == 0.0
    executor.add_plan(0, torch.ones(3, 8).numpy())
    assert executor.pop(0)[0] == pytest.approx(0.5)  # old chunk's step 1 and new chunk's step 0


def test_temporal_ensembling_decay_trusts_older_chunks():
    executor = _ChunkExecutor(1, 3, RolloutConfig(ensemble_decay=math.log(3.0)))
    executor.add_plan(0, torch.zeros(3, 8).numpy())
    executor.pop(0)
    executor.add_plan(0, torch.ones(3, 8).numpy())
    assert executor.pop(0)[0] == pytest.approx(0.25)  # weights 1 (old, value 0) and 1/3 (new, value 1)


def test_the_gripper_is_executed_fully_open_or_closed():
    """After blending, the gripper (last entry) becomes 1 above the threshold and 0 at or below it; the
    joint targets stay as predicted, and the stored chunks are not changed."""
    chunk = np.zeros((3, 8), dtype=np.float32)
    chunk[:, 0] = [0.3, 0.2, 0.1]
    chunk[:, -1] = [0.6, 0.5, 0.4]
    assert RolloutConfig().gripper_threshold == 0.25
    for rollout in (
        RolloutConfig(ensemble_decay=0.0, gripper_threshold=0.5),
        RolloutConfig(ensemble_decay=None, execute_steps=3, gripper_threshold=0.5),
    ):
        executor = _ChunkExecutor(1, 3, rollout)
        executor.add_plan(0, chunk)
        first = executor.pop(0)
        assert first[0] == pytest.approx(0.3) and first[-1] == 1.0
        if rollout.ensemble_decay is None:
            assert executor.pop(0)[-1] == 0.0 and executor.pop(0)[-1] == 0.0  # 0.5 is not above 0.5
        assert chunk[0, -1] == pytest.approx(0.6)
    executor = _ChunkExecutor(1, 3, RolloutConfig(gripper_threshold=0.65))
    executor.add_plan(0, chunk)
    assert executor.pop(0)[-1] == 0.0
    executor = _ChunkExecutor(1, 3, RolloutConfig(ensemble_decay=None, execute_steps=3))
    executor.add_plan(0, chunk * 0.5)  # 0.3, 0.25, 0.2 with the default threshold 0.25
    assert [executor.pop(0)[-1] for _ in range(3)] == [1.0, 0.0, 0.0]
    executor = _ChunkExecutor(1, 3, RolloutConfig(gripper_threshold=None))
    executor.add_plan(0, chunk)
    assert executor.pop(0)[-1] == pytest.approx(0.6)


@pytest.mark.parametrize("threshold,expected", [(0.25, {0.0, 1.0}), (None, None)])
def test_closed_loop_evaluation_sends_the_env_a_binary_gripper(monkeypatch, threshold, expected):
    """What the real environment receives: with the threshold only 0 and 1; without, the untrained
    policy's continuous values."""
    from simstream.tasks import TaskEnv

    sent: list[float] = []
    step = TaskEnv.step

    def recording_step(env, action):
        sent.append(float(action[-1]))
        return step(env, action)

    monkeypatch.setattr(TaskEnv, "step", recording_step)
    torch.manual_seed(0)
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    rollout = RolloutConfig(max_episode_steps=6, gripper_threshold=threshold)
    evaluate_policy(policy, HashedTextEmbedding(8), "pick_place", eval_seeds(2), rollout)
    assert len(sent) == 12
    if expected is None:
        assert not set(sent) <= {0.0, 1.0}
    else:
        assert set(sent) <= expected


def test_evaluation_gives_the_policy_back_in_the_mode_it_had():
    """It left the policy in eval mode: a training loop that evaluated now and then trained on without
    what training mode switches on (a vision policy's random shift, dropout)."""
    torch.manual_seed(0)
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    rollout = RolloutConfig(max_episode_steps=2)
    seen: list[bool] = []
    act = policy.act

    def recording_act(*args, **kwargs):
        seen.append(policy.training)
        return act(*args, **kwargs)

    policy.act = recording_act
    for training in (True, False):
        policy.train(training)
        evaluate_policy(policy, HashedTextEmbedding(8), "pick_place", eval_seeds(1), rollout)
        assert policy.training is training
    assert seen and not any(seen)  # every action came from eval mode

    def interrupt(finished: int) -> None:
        raise KeyboardInterrupt  # a Ctrl-C while it runs

    policy.train()
    with pytest.raises(KeyboardInterrupt):
        evaluate_policy(
            policy, HashedTextEmbedding(8), "pick_place", eval_seeds(1), rollout, on_step=interrupt
        )
    assert policy.training


def test_evaluation_runs_many_seeds_in_bounded_groups_with_the_same_results(monkeypatch):
    """Seeds beyond ``max_parallel`` run in later groups: never more simulators open than that, and the
    episodes, their order, the recorded videos and the progress count are those of one lockstep run."""
    import simstream.tasks as tasks

    open_envs, most = [0], [0]
    make_env = tasks.make_env

    def counted_make_env(*args, **kwargs):
        env = make_env(*args, **kwargs)
        close = env.close
        open_envs[0] += 1
        most[0] = max(most[0], open_envs[0])

        def counted_close():
            open_envs[0] -= 1
            close()

        env.close = counted_close
        return env

    monkeypatch.setattr(tasks, "make_env", counted_make_env)
    torch.manual_seed(0)
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    rollout = RolloutConfig(max_episode_steps=5)
    seeds = eval_seeds(4)  # groups of 2 and 2: a group of one runs the policy's products another way
    finished: list[int] = []
    grouped = evaluate_policy(
        policy, HashedTextEmbedding(8), "pick_place", seeds, rollout,
        record=3, image_size=16, on_step=finished.append, max_parallel=2,
    )  # fmt: skip
    assert most[0] == 2 and open_envs[0] == 0
    assert sum(finished) == 4
    whole = evaluate_policy(
        policy, HashedTextEmbedding(8), "pick_place", seeds, rollout, record=3, image_size=16
    )
    assert most[0] == 4 and open_envs[0] == 0
    assert grouped.seeds == whole.seeds == seeds
    assert grouped.lengths == whole.lengths == [5] * 4
    assert grouped.successes == whole.successes
    assert grouped.instructions == whole.instructions and len(set(whole.instructions)) > 1
    assert [len(f) for f in grouped.frames] == [len(f) for f in whole.frames] == [6, 6, 6]  # and the end
    for a, b in zip(grouped.frames, whole.frames):
        np.testing.assert_array_equal(np.stack(a), np.stack(b))
    with pytest.raises(ValueError, match=r"evaluate_policy.max_parallel must be an int >= 1, got 0"):
        evaluate_policy(policy, HashedTextEmbedding(8), "pick_place", seeds, rollout, max_parallel=0)


# ---------------------------------------------------------------------------------------- checkpoint, config
def test_an_interrupted_save_keeps_the_checkpoint_that_was_there(tmp_path, monkeypatch):
    """The demo saves twice into one file (before and after its final evaluation); a save cut short wrote
    over the first one in place and left a truncated file."""
    from simstream.bc import checkpoint as checkpoint_module

    policy = ChunkPolicy(PolicyConfig(history=1, horizon=4, hidden=16, layers=1, text_dim=8))
    saved = PolicyCheckpoint(policy, HashedTextEmbedding(8), "pick_place", RolloutConfig())
    path = save_checkpoint(tmp_path / "c.pt", saved)
    before = path.read_bytes()
    real_save = checkpoint_module.torch.save

    def cut_short(payload, target):
        real_save(payload, target)
        with open(target, "r+b") as file:
            file.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.torch, "save", cut_short)
    saved.info = {"success_rate": 0.5}
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, saved)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["c.pt"]
    monkeypatch.undo()
    assert load_checkpoint(path).info == {}


def test_checkpoint_round_trip(tmp_path):
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    embed = HashedTextEmbedding(8)
    path = save_checkpoint(
        tmp_path / "c.pt", PolicyCheckpoint(policy, embed, "pick_place", RolloutConfig(execute_steps=3))
    )
    loaded = load_checkpoint(path)
    assert loaded.task == "pick_place" and loaded.rollout.execute_steps == 3
    features, mask = torch.randn(1, 2, FEATURE_DIM), torch.ones(1, 2, dtype=torch.bool)
    torch.testing.assert_close(
        loaded.policy.act(features, mask, embed([RED])), policy.act(features, mask, embed([RED]))
    )


def test_a_checkpoint_from_before_the_gripper_threshold_gets_it_and_a_newer_rollout_is_refused(tmp_path):
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    checkpoint = PolicyCheckpoint(
        policy, HashedTextEmbedding(8), "pick_place", RolloutConfig(gripper_threshold=None)
    )
    path = save_checkpoint(tmp_path / "c.pt", checkpoint)
    assert load_checkpoint(path).rollout.gripper_threshold is None
    payload = torch.load(path, weights_only=True)
    del payload["rollout"]["gripper_threshold"]  # as written before the field existed
    torch.save(payload, path)
    assert load_checkpoint(path).rollout.gripper_threshold == 0.25
    payload["rollout"]["telepathy"] = 1
    torch.save(payload, path)
    with pytest.raises(ValueError, match="its rollout does not fit this simstream version's RolloutConfig"):
        load_checkpoint(path)
    payload["rollout"] = {"gripper_threshold": 1.5}
    torch.save(payload, path)
    message = (
        "its rollout is invalid: RolloutConfig.gripper_threshold must be None or a number in (0, 1), got 1.5"
    )
    with pytest.raises(ValueError, match=re.escape(f"{str(path)!r}: {message}")):
        load_checkpoint(path)


def test_numpy_values_and_paths_are_saved_as_plain_values_and_objects_are_refused(tmp_path):
    """What load_checkpoint's weights-only reading accepts: a NumPy number (a numpy.float64 is a float,
    yet it pickled as NumPy's) or a path used to make a checkpoint that loaded as "not a checkpoint"."""
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    rollout = RolloutConfig(ensemble_decay=np.float64(0.1), gripper_threshold=np.float32(0.5))
    info = {
        "steps": np.int64(3),
        "rate": np.float64(0.25),
        "run": tmp_path / "run",
        "seeds": (1, np.int32(2)),
    }
    path = save_checkpoint(
        tmp_path / "c.pt", PolicyCheckpoint(policy, HashedTextEmbedding(8), "pick_place", rollout, info)
    )
    loaded = load_checkpoint(path)
    assert loaded.info == {"steps": 3, "rate": 0.25, "run": str(tmp_path / "run"), "seeds": (1, 2)}
    assert type(loaded.info["rate"]) is float and type(loaded.info["steps"]) is int
    assert loaded.rollout.ensemble_decay == 0.1 and loaded.rollout.gripper_threshold == 0.5
    kept = {"by_seed": {7: True, 0.5: "x"}, "raw": b"\x00", "z": 1 + 2j}  # what weights-only loading reads
    path = save_checkpoint(
        tmp_path / "k.pt", PolicyCheckpoint(policy, HashedTextEmbedding(8), "pick_place", rollout, kept)
    )
    assert load_checkpoint(path).info == kept
    odd = PolicyCheckpoint(policy, HashedTextEmbedding(8), "pick_place", RolloutConfig(), {"when": object()})
    with pytest.raises(
        ValueError, match=r"PolicyCheckpoint.info\['when'\] holds a builtins.object; a checkpoint"
    ):
        save_checkpoint(tmp_path / "odd.pt", odd)
    assert not (tmp_path / "odd.pt").exists()


def test_load_checkpoint_rejects_other_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a simstream policy checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    (tmp_path / "report.md").write_text("# a report, not a checkpoint")
    # one line, without torch's advice to load an unknown file with weights_only=False
    message = (
        f"{str(tmp_path / 'report.md')!r} is not a simstream policy checkpoint: torch.load cannot read it ("
    )
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        load_checkpoint(tmp_path / "report.md")
    assert "\n" not in str(raised.value) and "weights_only" not in str(raised.value)


def test_a_damaged_or_mismatched_checkpoint_is_refused_naming_the_file(tmp_path):
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    checkpoint = PolicyCheckpoint(policy, HashedTextEmbedding(8), "pick_place", RolloutConfig())
    path = save_checkpoint(tmp_path / "c.pt", checkpoint)
    good = torch.load(path, weights_only=True)
    for damage, message in [
        (lambda p: p.pop("rollout"), "is not a whole simstream policy checkpoint: it has no ['rollout']"),
        (lambda p: p["state_dict"].pop("select.weight"), ": its weights do not fit its policy_config: "),
        (
            lambda p: p["text_embedding"].update(dim=16),
            ": the text embedding has dim 16, the policy reads text_dim 8",
        ),
        (lambda p: p.update(text_embedding={}), ": its text_embedding is invalid: KeyError('dim')"),
        (lambda p: p.update(state_dict=[]), ": its state_dict is not a policy's weights: TypeError("),
        (lambda p: p.update(rollout=None), ": its rollout is invalid: not a mapping of field names"),
        (lambda p: p.update(policy_config=[1]), ": its policy_config is invalid: not a mapping of field"),
    ]:
        payload = torch.load(path, weights_only=True)
        damage(payload)
        torch.save(payload, tmp_path / "bad.pt")
        with pytest.raises(
            ValueError, match=re.escape(repr(str(tmp_path / "bad.pt"))) + ".*" + re.escape(message)
        ):
            load_checkpoint(tmp_path / "bad.pt")
    torch.save(good, path)
    load_checkpoint(path)
    wrong = PolicyCheckpoint(policy, HashedTextEmbedding(16), "pick_place", RolloutConfig())
    with pytest.raises(ValueError, match="the text embedding has dim 16, the policy reads text_dim 8"):
        save_checkpoint(tmp_path / "w.pt", wrong)
    assert not (tmp_path / "w.pt").exists()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"steps": 0}, "DemoConfig.steps must be an int >= 1, got 0"),
        ({"lr": -1.0}, "DemoConfig.lr must be a finite number > 0, got -1.0"),
        ({"name": "a/b"}, "DemoConfig.name must be a folder name"),
        ({"task": "nope"}, "task must be one of"),
        ({"execute_steps": 0}, "RolloutConfig.execute_steps must be an int >= 1"),
        # the checks during training run seeds from offset 10000: more would evaluate on seeds they ran
        ({"eval_episodes": 10_001}, "DemoConfig.eval_episodes must be an int in [1, 10000], got 10001"),
        (
            {"eval_episodes_during": 10_001},
            "DemoConfig.eval_episodes_during must be an int in [0, 10000], got 10001",
        ),
        (
            {"ensemble_decay": None, "horizon": 4, "execute_steps": 8},
            "DemoConfig.execute_steps must be an int in [1, 4], got 8",
        ),
        ({"weight_decay": -1.0}, "DemoConfig.weight_decay must be a finite number >= 0, got -1.0"),
        ({"time_limit_s": True}, "DemoConfig.time_limit_s must be a finite number > 0, got True"),
        ({"buffer_size": 1, "num_workers": 2}, "DemoConfig.buffer_size must be >= num_workers (2), got 1"),
        ({"idle_threads": -1}, "DemoConfig.idle_threads must be an int in [0, 256], got -1"),
        ({"idle_threads": 257}, "DemoConfig.idle_threads must be an int in [0, 256], got 257"),
        # torch.set_num_threads failed after the run folder was made, naming no option ("Overflow when ...")
        ({"num_threads": 2**40}, f"DemoConfig.num_threads must be an int in [1, 256], got {2**40}"),
        ({"num_threads": 0}, "DemoConfig.num_threads must be an int in [1, 256], got 0"),
        ({"name": "a\0b"}, "DemoConfig.name must be a folder name (not empty, '.' or '..', no '/' or NUL"),
        ({"name": "n" * 256}, "DemoConfig.name must be a folder name (not empty, '.' or '..', no '/' or NUL"),
        ({"ema_decay": 1.0}, "DemoConfig.ema_decay must be a number in [0, 1), got 1.0"),
        ({"ema_decay": -0.1}, "DemoConfig.ema_decay must be a number in [0, 1), got -0.1"),
        ({"ema_decay": float("nan")}, "DemoConfig.ema_decay must be a number in [0, 1), got nan"),
        (
            {"ensemble_decay": float("nan")},
            "RolloutConfig.ensemble_decay must be None or a finite number >= 0, got nan",
        ),
        (
            {"gripper_threshold": 0.0},
            "RolloutConfig.gripper_threshold must be None or a number in (0, 1), got 0.0",
        ),
        (
            {"gripper_threshold": 1.0},
            "RolloutConfig.gripper_threshold must be None or a number in (0, 1), got 1.0",
        ),
        (
            {"gripper_threshold": True},
            "RolloutConfig.gripper_threshold must be None or a number in (0, 1), got True",
        ),
    ],
)
def test_demo_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DemoConfig(**kwargs)


def test_a_normalisation_batch_that_would_not_fit_in_memory_is_refused_before_anything_starts(
    monkeypatch, tmp_path
):
    """Only the training batch was checked: the 8192 contexts the normalisation is fitted on (3.4 GiB at
    history = horizon = 1024) failed once the producers ran, or were OOM-killed."""
    import simstream.sampling.gather as gather
    from simstream.bc.demo import check_demo_setup

    monkeypatch.setattr(gather, "physical_memory", lambda: 2 * 2**30)
    long = DemoConfig(
        history=1024, horizon=1024, max_episode_steps=2048, batch_size=1, runs_dir=str(tmp_path)
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "DemoConfig.history=1024 with horizon=1024 needs 3.4 GiB for one batch of the 8192 contexts the "
            "normalisation is fitted on, more than this machine's 2.0 GiB of memory: history + horizon - 1 "
            "can be at most 1202 here"
        ),
    ):
        check_demo_setup(long)
    assert check_demo_setup(DemoConfig(runs_dir=str(tmp_path))) is not None  # the defaults fit
    assert not list(tmp_path.iterdir())  # nothing written


def test_quick_preset_keeps_other_settings():
    quick = DemoConfig(seed=3).with_quick()
    assert quick.quick and quick.seed == 3 and quick.steps < DemoConfig().steps


def test_trainer_threads_take_the_cores_only_while_the_producers_are_idle():
    """Between generations the trainer uses ``idle_threads``; from a refill request until the generation is
    complete, ``num_threads`` (the producer stalls in its second generation, so the refill stays
    outstanding)."""
    from simstream import OnlineDataEngine
    from simstream.bc.train import _TrainerThreads
    from tests.support.engines import make_cfg
    from tests.support.sources import ScriptedSpec

    before = torch.get_num_threads()
    spec = ScriptedSpec(fault="stall", fault_after=2)  # 4 rows of 2 envs: the first generation is 2 rollouts
    engine = OnlineDataEngine(make_cfg(spec, num_workers=1, refill_policy="manual"))
    try:
        with engine:
            unchanged = _TrainerThreads(engine, busy=1, idle=0)
            assert unchanged.update() is False and torch.get_num_threads() == 1
            threads = _TrainerThreads(engine, busy=1, idle=2)
            assert torch.get_num_threads() == 1
            assert threads.update() is True and torch.get_num_threads() == 2
            engine.request_refill()
            assert threads.update() is False and torch.get_num_threads() == 1
            assert unchanged.update() is False and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_noisy_producers_get_more_attempts_per_window():
    """With ``--action-noise`` a window's episode fails now and then (13% at 0.03 rad), so the demo gives
    each window ``NOISY_EXPERT_ATTEMPTS``; without noise the engine's default stands."""
    from simstream import OnlineDataEngineCfg
    from simstream.bc.camera_source import CameraSourceSpec
    from simstream.bc.demo import NOISY_EXPERT_ATTEMPTS, engine_config

    vision = DemoConfig().with_vision()
    noisy = engine_config(dataclasses.replace(vision, action_noise=0.03))
    assert NOISY_EXPERT_ATTEMPTS == 10 and noisy.max_generation_attempts == 10
    assert isinstance(noisy.source, CameraSourceSpec) and noisy.source.action_noise == 0.03
    default = OnlineDataEngineCfg.max_generation_attempts
    assert engine_config(vision).max_generation_attempts == default == 3
    assert engine_config(DemoConfig()).max_generation_attempts == default
    assert engine_config(vision).refill_threshold == 0 and vision.idle_threads == 0  # streams continuously


@pytest.mark.parametrize(
    ("name", "value", "default"),
    [
        ("action_noise", 0.2, 0.0),
        ("object_aux_weight", 1.0, 0.0),
        ("cameras", ("top",), ("front", "wrist")),
        ("image_size", 128, 64),
        ("shift", 8, 4),
        ("channels", 32, 16),
    ],
)
def test_a_camera_policy_option_without_vision_is_refused(name, value, default):
    """It trained the state policy, which never reads it, and the summary recorded it as applied."""
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"DemoConfig.{name} must be {default!r} (its default) without --vision (vision=False): it "
            f"applies to the camera policy only, got {value!r}. Add --vision, or leave the option out"
        ),
    ):
        DemoConfig(**{name: value})
    assert getattr(DemoConfig(vision=True, **{name: value}), name) == value


def test_cameras_given_as_a_list_are_taken_as_a_tuple():
    assert DemoConfig(cameras=["front", "wrist"]).cameras == ("front", "wrist")
    with pytest.raises(ValueError, match=r"DemoConfig.cameras must be one or more distinct cameras"):
        DemoConfig(cameras=["front", "front"])


# ---------------------------------------------------------------------------------------- weight average
def test_weight_average_copies_first_then_blends_with_a_warm_up():
    """The first update copies; the n-th after it blends with ``min(decay, (1 + n) / (10 + n))``, buffers
    included; ``decay 0`` keeps no average."""
    from simstream.bc.train import weight_average

    policy = ChunkPolicy(PolicyConfig(hidden=16, layers=1))
    assert weight_average(policy, 0.0) is None
    averaged = weight_average(policy, 0.5)
    expected = None
    for step, value in enumerate([1.0, 3.0, -2.0, 5.0] + [0.25] * 20):
        with torch.no_grad():
            policy.head.weight.fill_(value)
            policy.target_mean.fill_(2 * value)
        averaged.update_parameters(policy)
        if expected is None:
            expected = value
        else:
            decay = min(0.5, (1.0 + step) / (10.0 + step))  # ``step`` updates came before this one
            expected = decay * expected + (1 - decay) * value
        assert torch.allclose(averaged.module.head.weight, torch.full_like(policy.head.weight, expected))
        assert torch.allclose(averaged.module.target_mean, torch.full_like(policy.target_mean, 2 * expected))
    assert abs(expected - 0.25) < 1e-3  # after the warm-up the decay is 0.5: the average caught up
    assert torch.equal(policy.head.weight, torch.full_like(policy.head.weight, 0.25))  # model untouched


def test_weight_average_blends_every_dtype_group_alike():
    """AveragedModel blends each (device, dtype) group in its own call: one update must give every group
    the same warm-up weight."""
    from simstream.bc.train import weight_average

    model = torch.nn.Module()
    model.low = torch.nn.Parameter(torch.zeros(3))
    model.high = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    averaged = weight_average(model, 0.9)
    averaged.update_parameters(model)  # copies the zeros
    with torch.no_grad():
        model.low.fill_(1.0)
        model.high.fill_(1.0)
    averaged.update_parameters(model)  # the first blend: decay min(0.9, 2 / 11)
    expected = 1 - 2 / 11
    assert torch.allclose(averaged.module.low, torch.full((3,), expected))
    assert torch.allclose(averaged.module.high, torch.full((3,), expected, dtype=torch.float64))


def test_training_with_a_weight_average_ends_with_the_average_in_the_policy(monkeypatch):
    """``train_policy`` with ``ema_decay`` trains the policy and hands back the average of its weights, not
    the last ones (a real engine streaming ``pick_place``)."""
    import time

    import tqdm

    from simstream import OnlineDataEngine, OnlineDataEngineCfg
    from simstream.bc import train as training
    from simstream.tasks import make_source

    kept = {}

    def recording_average(policy, decay):
        averaged = weight_average(policy, decay)
        update = averaged.update_parameters

        def update_and_keep(model):
            update(model)
            kept["last"] = {key: value.clone() for key, value in model.state_dict().items()}

        averaged.update_parameters = update_and_keep
        kept["averaged"] = averaged
        return averaged

    weight_average = training.weight_average
    monkeypatch.setattr(training, "weight_average", recording_average)
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no tqdm monitor thread outliving the test
    checked = []
    monkeypatch.setattr(training, "_check", lambda model, *args: checked.append((model, args[3])))
    cfg = DemoConfig(steps=12, batch_size=16, hidden=32, layers=1, ema_decay=0.9, eval_every=6)
    policy = ChunkPolicy(cfg.policy_config)
    embedding = HashedTextEmbedding(cfg.text_dim)
    source = make_source("pick_place", num_envs=1, max_episode_steps=cfg.max_episode_steps)
    with OnlineDataEngine(OnlineDataEngineCfg(source=source, buffer_size=2, num_workers=1)) as engine:
        instructions = InstructionTable(engine.language_registry, embedding)
        training.fit_normalizer(engine, policy, instructions, torch.Generator().manual_seed(0))
        log = training.train_policy(engine, policy, embedding, cfg, deadline=time.monotonic() + 60)
    assert log.steps_done == 12 and not log.stopped_early
    assert [step for _, step in checked] == [6, 12]  # the checks evaluated the average
    assert all(model is kept["averaged"].module for model, _ in checked)
    state, last = policy.state_dict(), kept["last"]
    assert all(torch.equal(state[key], value) for key, value in kept["averaged"].module.state_dict().items())
    assert not torch.equal(state["head.weight"], last["head.weight"])  # the average, not the last weights
    assert torch.equal(state["target_std"], last["target_std"])  # constant buffers stay as fitted


def test_training_that_fails_while_it_sets_up_leaves_no_prefetch_thread(monkeypatch):
    """The batch prefetcher (a thread that starts sampling at once) was made first, and a failure in the
    steps after it, before the try that closes it, left the thread sampling the engine."""
    import threading
    import time

    from simstream.bc import train as training

    sampled, release = [], threading.Event()

    class _Engine:
        language_registry = _Registry()

        def sample_batch_with_context(self, *args, **kwargs):
            sampled.append(args)
            release.wait(10.0)  # a sampler waiting for data, as a real one does
            raise RuntimeError("no data")

    def no_stats(engine, batch_size):
        raise RuntimeError("get_stats failed")

    monkeypatch.setattr(training, "_StreamMeter", no_stats)
    cfg = DemoConfig(steps=2, batch_size=4, hidden=16, layers=1, text_dim=8, eval_episodes_during=0)
    policy = ChunkPolicy(cfg.policy_config)
    try:
        with pytest.raises(RuntimeError, match="get_stats failed"):
            training.train_policy(
                _Engine(), policy, HashedTextEmbedding(8), cfg, deadline=time.monotonic() + 9
            )
        threads = [thread for thread in threading.enumerate() if thread.name == "simstream-batch-prefetch"]
        assert threads == [] and sampled == []
    finally:
        release.set()


def test_a_renderer_that_cannot_be_made_leaves_no_simulator_or_renderer_open(monkeypatch):
    """The simulators and video renderers were made before the evaluation's cleanup took charge of them:
    a GL context refused for the second video left the first renderer and every simulator open."""
    import simstream.tasks as tasks

    envs, renderers, closed = [], [], []
    make_env = tasks.make_env

    def tracked(thing):
        close = thing.close

        def tracked_close():
            closed.append(thing)
            close()

        thing.close = tracked_close
        return thing

    def tracked_make_env(*args, **kwargs):
        env = tracked(make_env(*args, **kwargs))
        make_renderer = env.scene._make_renderer

        def renderer_or_failure(size):
            if len(renderers) == 1:
                raise RuntimeError("no GL context left")
            renderers.append(tracked(make_renderer(size)))
            return renderers[-1]

        env.scene._make_renderer = renderer_or_failure
        envs.append(env)
        return env

    monkeypatch.setattr(tasks, "make_env", tracked_make_env)
    policy = ChunkPolicy(PolicyConfig(history=2, horizon=4, hidden=16, layers=1, text_dim=8))
    with pytest.raises(RuntimeError, match=r"^no GL context left$"):
        evaluate_policy(
            policy, HashedTextEmbedding(8), "pick_place", eval_seeds(3), RolloutConfig(max_episode_steps=5),
            record=2, image_size=16,
        )  # fmt: skip
    assert len(envs) == 3 and len(renderers) == 1
    assert sorted(map(id, closed)) == sorted(map(id, envs + renderers))
