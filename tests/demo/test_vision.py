"""The vision policy's data path: camera frames through the engine into the policy, and nothing privileged.

Unit tests run in-process; ``test_camera_frames_stream_through_the_engine_into_the_policy`` starts a real
producer that renders with MuJoCo.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from simstream.bc import DemoConfig, HashedTextEmbedding, load_checkpoint, save_checkpoint
from simstream.bc.camera_source import CameraSourceSpec, image_key
from simstream.bc.checkpoint import PolicyCheckpoint
from simstream.bc.data import InstructionTable
from simstream.bc.evaluate import RolloutConfig
from simstream.bc.policy import masked_chunk_loss
from simstream.bc.prefetch import BatchPrefetcher
from simstream.bc.train import batch_sampler
from simstream.bc.vision import (
    ESTIMATE_DIM,
    OBJECT_DIM,
    PROPRIO_DIM,
    VisionPolicy,
    VisionPolicyConfig,
    object_positions,
    policy_keys,
    proprio_features,
    random_shift,
    vision_context_batch,
)

pytestmark = pytest.mark.timeout(120)

CAMERAS = ("front", "wrist")
B, H, F, S = 4, 2, 3, 16


class _Registry:
    def resolve(self, indices, kind):
        return ["pick up the red cube and place it in the bin"] * len(indices)


def _context_batch(generator: torch.Generator) -> TensorDict:
    """A ``[B, H + F - 1]`` context batch shaped like the vision source's, first frame padded in row 0."""
    T = H + F - 1
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 0] = False
    images = {
        camera: torch.randint(0, 256, (B, T, 3, S, S), dtype=torch.uint8, generator=generator)
        for camera in CAMERAS
    }
    for frames in images.values():
        frames[0, 0] = 0  # padding holds zero payload
    return TensorDict(
        {
            "obs": {
                "state": torch.randn(B, T, 23, generator=generator),
                "objects": torch.randn(B, T, 21, generator=generator),
                "images": images,
            },
            "actions": torch.randn(B, T, 8, generator=generator),
            "valid": valid,
            "loss_mask": valid.clone(),
            "task_index": torch.zeros(B, T, dtype=torch.int64),
        },
        batch_size=[B, T],
    )


def _instructions() -> InstructionTable:
    return InstructionTable(_Registry(), HashedTextEmbedding(64))


def _policy(**overrides) -> VisionPolicy:
    torch.manual_seed(0)
    return VisionPolicy(
        VisionPolicyConfig(image_size=S, history=H, horizon=F, hidden=32, channels=8, **overrides)
    )


# ------------------------------------------------------------------------------------------ augmentation
def test_random_shift_keeps_shape_and_dtype_and_moves_the_content():
    images = torch.zeros(2, 3, S, S, dtype=torch.uint8)
    images[:, :, 8, 8] = 255  # one bright pixel away from the border
    shifted = random_shift(images, 4, torch.Generator().manual_seed(1))
    assert shifted.shape == images.shape and shifted.dtype == torch.uint8
    dy, dx = torch.randint(0, 9, (2, 2), generator=torch.Generator().manual_seed(1))
    for n in range(2):  # out[y, x] = padded[y + dy, x + dx]: the pixel moves by (4 - dy, 4 - dx)
        (y, x) = torch.nonzero(shifted[n, 0]).tolist()[0]
        assert (y, x) == (8 + 4 - int(dy[n]), 8 + 4 - int(dx[n]))
        assert shifted[n].sum() == images[n].sum()
    assert not torch.equal(shifted, images)
    assert random_shift(images, 0) is images


def test_random_shift_is_the_documented_crop_of_the_replicated_padding():
    generator = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (5, 3, S, S), dtype=torch.uint8, generator=generator)
    shifted = random_shift(images, 3, torch.Generator().manual_seed(4))
    dy, dx = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(4))
    rows = (torch.arange(S)[None, :] + dy[:, None] - 3).clamp(0, S - 1)  # replicate = clamp the index
    cols = (torch.arange(S)[None, :] + dx[:, None] - 3).clamp(0, S - 1)
    for n in range(5):
        assert torch.equal(shifted[n], images[n][:, rows[n]][:, :, cols[n]])


def test_random_shift_fills_with_the_replicated_border():
    images = torch.arange(S, dtype=torch.float32).repeat(1, 1, S, 1)  # column index as the value
    shifted = random_shift(images, 4, torch.Generator().manual_seed(0))
    assert set(shifted.flatten().tolist()) <= set(range(S))  # never zeros from outside the image


def test_training_mode_augments_and_eval_mode_is_deterministic():
    data = vision_context_batch(_context_batch(torch.Generator().manual_seed(0)), H, _instructions(), CAMERAS)
    policy = _policy()
    policy.eval()
    assert torch.equal(policy(*data.inputs()), policy(*data.inputs()))
    policy.train()
    torch.manual_seed(3)
    first = policy(*data.inputs())
    assert not torch.equal(first, policy(*data.inputs()))  # a new random shift every call


# ------------------------------------------------------------------------------------------ no privilege
def test_policy_keys_name_images_proprioception_actions_and_language_only():
    assert policy_keys(CAMERAS) == [
        "obs/images/front",
        "obs/images/wrist",
        "obs/state",
        "actions",
        "task_index",
    ]
    assert not any("objects" in key for key in policy_keys(CAMERAS))


def test_changing_the_cube_poses_in_a_batch_does_not_change_the_policy_input_or_output():
    batch = _context_batch(torch.Generator().manual_seed(0))
    before = vision_context_batch(batch, H, _instructions(), CAMERAS)
    batch["obs", "objects"] = torch.randn(batch["obs", "objects"].shape) * 100
    after = vision_context_batch(batch, H, _instructions(), CAMERAS)
    for a, b in zip(before.inputs(), after.inputs()):
        if isinstance(a, dict):
            assert a.keys() == b.keys() == set(CAMERAS)
            assert all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert torch.equal(a, b)
    policy = _policy()
    policy.eval()
    assert torch.equal(policy(*before.inputs()), policy(*after.inputs()))
    # and the proprioception is the robot's: joints, fingers, gripper pose, never velocities
    assert before.proprio.shape == (B, H, PROPRIO_DIM)
    state = batch["obs", "state"][:, :H]
    assert torch.equal(before.proprio[1:], proprio_features(state)[1:])


def test_the_trainer_asks_the_engine_for_the_policy_keys_only():
    calls = []

    class Engine:
        def sample_batch_with_context(self, batch_size, history, horizon, *, generator, keys):
            calls.append((batch_size, history, horizon, keys))
            return _context_batch(torch.Generator().manual_seed(0))

    data = batch_sampler(Engine(), _policy(), _instructions(), B, torch.Generator())()
    assert calls == [(B, H, F, policy_keys(CAMERAS))]
    assert set(data.images) == set(CAMERAS)
    batch_sampler(Engine(), _policy(), _instructions(), B, torch.Generator(), images=False)()
    assert calls[-1][3] == ["obs/state", "actions", "task_index"]


# ------------------------------------------------------------- the auxiliary cube-position head (a target)
def test_object_positions_are_the_position_of_each_cube_in_colour_order():
    objects = torch.arange(2 * 21, dtype=torch.float32).view(2, 21)
    expected = torch.tensor([0, 1, 2, 7, 8, 9, 14, 15, 16], dtype=torch.float32)
    assert torch.equal(object_positions(objects), torch.stack([expected, expected + 21]))


def test_the_auxiliary_head_reads_the_cube_poses_as_a_target_never_as_an_input():
    batch = _context_batch(torch.Generator().manual_seed(0))
    plain = vision_context_batch(batch, H, _instructions(), CAMERAS)
    with_targets = vision_context_batch(batch, H, _instructions(), CAMERAS, objects=True)
    assert plain.object_targets is None
    assert torch.equal(with_targets.object_targets, object_positions(batch["obs", "objects"][:, H - 1]))
    policy = _policy(object_dim=OBJECT_DIM)
    policy.eval()
    output = policy(*with_targets.inputs())
    assert torch.equal(output, policy(*plain.inputs()))  # the targets change nothing the policy reads
    batch["obs", "objects"] = torch.randn(batch["obs", "objects"].shape) * 100
    changed = vision_context_batch(batch, H, _instructions(), CAMERAS, objects=True)
    assert torch.equal(policy(*changed.inputs()), output)
    # the auxiliary loss is the head's mean squared error on the normalised positions
    policy.object_mean.fill_(1.0)
    policy.object_std.fill_(2.0)
    prediction, objects = policy.forward_with_objects(*changed.inputs())
    assert torch.equal(prediction, output)
    expected = (objects - (changed.object_targets - 1.0) / 2.0).pow(2).mean()
    assert torch.allclose(policy.object_loss(objects, changed.object_targets), expected)


def test_the_auxiliary_loss_trains_the_camera_encoders():
    batch = _context_batch(torch.Generator().manual_seed(0))
    data = vision_context_batch(batch, H, _instructions(), CAMERAS, objects=True)
    policy = _policy(object_dim=OBJECT_DIM)
    _, objects = policy.forward_with_objects(*data.inputs())
    policy.object_loss(objects, data.object_targets).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.object_head.parameters())
    assert policy.encoders["front"].convs[0].weight.grad.abs().sum() > 0
    assert policy.head.weight.grad is None  # the action head is not part of it


@pytest.mark.parametrize("object_input", [False, True])
def test_a_training_loss_runs_the_auxiliary_head_once_and_matches_two_passes(object_input):
    import contextlib

    from simstream.bc.train import _loss

    data = vision_context_batch(_context_batch(torch.Generator().manual_seed(0)), H, _instructions(), CAMERAS,
                                objects=True)  # fmt: skip
    policy = _policy(object_dim=OBJECT_DIM, object_input=object_input)
    policy.fit_normalizer(data.proprio, data.history_mask, data.targets, data.loss_mask, data.object_targets)
    policy.eval()  # no random shift: every pass below sees the same frames
    calls = []
    policy.object_head.register_forward_hook(lambda *_: calls.append(1))
    loss = _loss(policy, data, 0.5, contextlib.nullcontext())
    assert len(calls) == 1
    prediction = policy(*data.inputs())
    _, objects = policy.forward_with_objects(*data.inputs())
    chunk = masked_chunk_loss(prediction.float(), policy.normalize_targets(data.targets), data.loss_mask)
    assert torch.allclose(loss, chunk + 0.5 * policy.object_loss(objects, data.object_targets))
    with pytest.raises(ValueError, match="forward_with_objects needs a policy with object_dim > 0"):
        _policy().forward_with_objects(*data.inputs())


def test_fitting_the_normaliser_of_a_policy_with_the_auxiliary_head_needs_its_targets():
    data = vision_context_batch(_context_batch(torch.Generator().manual_seed(0)), H, _instructions(), CAMERAS,
                                objects=True)  # fmt: skip
    policy = _policy(object_dim=OBJECT_DIM)
    with pytest.raises(ValueError, match=r"VisionPolicy\.fit_normalizer\.object_targets must be a"):
        policy.fit_normalizer(data.proprio, data.history_mask, data.targets, data.loss_mask)
    policy.fit_normalizer(data.proprio, data.history_mask, data.targets, data.loss_mask, data.object_targets)
    assert torch.allclose(policy.object_mean, data.object_targets.mean(0))
    assert torch.allclose(policy.object_std, data.object_targets.std(0).clamp_min(1e-3))


def test_the_trainer_asks_for_the_cube_poses_only_with_the_auxiliary_head():
    calls = []

    class Engine:
        def sample_batch_with_context(self, batch_size, history, horizon, *, generator, keys):
            calls.append(keys)
            return _context_batch(torch.Generator().manual_seed(0))

    data = batch_sampler(Engine(), _policy(object_dim=OBJECT_DIM), _instructions(), B, torch.Generator())()
    assert calls[-1] == [*policy_keys(CAMERAS), "obs/objects"]
    assert data.object_targets.shape == (B, OBJECT_DIM)
    data = batch_sampler(Engine(), _policy(), _instructions(), B, torch.Generator())()
    assert calls[-1] == policy_keys(CAMERAS) and data.object_targets is None


def test_demo_config_gives_the_policy_the_auxiliary_head_with_a_positive_weight():
    assert DemoConfig(vision=True, object_aux_weight=0.0).policy_config.object_dim == 0
    assert DemoConfig(vision=True, object_aux_weight=0.5).policy_config.object_dim == OBJECT_DIM
    estimating = DemoConfig(vision=True, object_aux_weight=0.5, object_input=True).policy_config
    assert estimating.object_input and estimating.object_dim == OBJECT_DIM


# ------------------------------------------------ the head's own cube estimate as an input (object_input)
def _fitted_estimating_policy() -> tuple[VisionPolicy, object]:
    batch = _context_batch(torch.Generator().manual_seed(0))
    data = vision_context_batch(batch, H, _instructions(), CAMERAS, objects=True)
    policy = _policy(object_dim=OBJECT_DIM, object_input=True)
    policy.fit_normalizer(data.proprio, data.history_mask, data.targets, data.loss_mask, data.object_targets)
    return policy, data


def test_the_estimate_offsets_are_normalised_with_the_true_offsets_from_the_gripper():
    policy, data = _fitted_estimating_policy()
    batch = _context_batch(torch.Generator().manual_seed(0))
    gripper = batch["obs", "state"][:, H - 1, 16:19]  # the TCP position in obs/state, at the anchor
    offsets = data.object_targets - gripper.repeat(1, 3)
    assert torch.allclose(policy.offset_mean, offsets.mean(0))
    assert torch.allclose(policy.offset_std, offsets.std(0).clamp_min(1e-3))


def test_the_action_head_reads_the_estimate_made_from_pixels_not_the_true_cube_poses():
    policy, data = _fitted_estimating_policy()
    policy.eval()
    output = policy(*data.inputs())
    batch = _context_batch(torch.Generator().manual_seed(0))
    batch["obs", "objects"] = torch.randn(batch["obs", "objects"].shape) * 100
    changed = vision_context_batch(batch, H, _instructions(), CAMERAS, objects=True)
    assert torch.equal(policy(*changed.inputs()), output)  # the true poses change nothing it reads
    with torch.no_grad():  # a different estimate changes the actions: the head does read it
        policy.object_head[-1].bias.add_(1.0)
    assert not torch.allclose(policy(*data.inputs()), output)
    _, objects = policy.forward_with_objects(*data.inputs())
    estimate = policy._estimate_inputs(objects, data.proprio[:, -1], data.text)
    assert estimate.shape == (B, ESTIMATE_DIM)
    positions = objects * policy.object_std + policy.object_mean
    expected = (positions - data.proprio[:, -1, 9:12].repeat(1, 3) - policy.offset_mean) / policy.offset_std
    assert torch.allclose(estimate[:, OBJECT_DIM : 2 * OBJECT_DIM], expected, atol=1e-6)


def test_only_the_auxiliary_loss_trains_the_estimate():
    """The action loss reaches the instruction's cube selection and the encoders, never the estimate's
    head: the estimate stays an estimate of where the cubes are."""
    policy, data = _fitted_estimating_policy()
    policy(*data.inputs()).pow(2).mean().backward()
    assert all(p.grad is None for p in policy.object_head.parameters())
    assert policy.select.weight.grad is not None and policy.select.weight.grad.abs().sum() > 0
    assert policy.encoders["front"].convs[0].weight.grad.abs().sum() > 0


def test_the_instruction_selects_the_named_cubes_slot():
    policy, data = _fitted_estimating_policy()
    policy.eval()
    _, objects = policy.forward_with_objects(*data.inputs())
    for cube in range(3):
        with torch.no_grad():
            policy.select.weight.zero_()
            policy.select.bias.copy_(torch.full((3,), -1e4))
            policy.select.bias[cube] = 0.0
        inputs = policy._estimate_inputs(objects, data.proprio[:, -1], data.text)
        estimate, offsets = inputs[:, :OBJECT_DIM], inputs[:, OBJECT_DIM : 2 * OBJECT_DIM]
        expected = torch.cat([estimate[:, 3 * cube : 3 * cube + 3], offsets[:, 3 * cube : 3 * cube + 3]], -1)
        assert torch.allclose(inputs[:, 2 * OBJECT_DIM :], expected)


def test_evaluation_hands_a_vision_policy_no_object_pose():
    """What a vision policy is given in closed loop: its cameras, rendered, and the proprioception; the
    observation's cube poses could be anything."""
    import inspect

    from simstream.bc.evaluate import _frame_inputs
    from simstream.tasks import make_env

    assert "objects" not in inspect.signature(VisionPolicy.forward).parameters
    policy = _policy(object_dim=OBJECT_DIM, object_input=True)
    env = make_env("pick_place")
    try:
        observation = env.reset(3)
        poisoned = {**observation, "objects": np.full_like(observation["objects"], np.nan)}
        frames = _frame_inputs(policy, [env], [observation], [0])
        without = _frame_inputs(policy, [env], [poisoned], [0])
    finally:
        env.close()
    assert set(frames) == {"proprio", *CAMERAS}
    assert all(torch.equal(frames[key], without[key]) for key in frames)
    assert not torch.isnan(without["proprio"]).any()


def test_a_checkpoint_from_before_the_estimate_loads_and_a_newer_one_is_refused(tmp_path):
    policy = _policy(object_dim=OBJECT_DIM)
    checkpoint = PolicyCheckpoint(policy, HashedTextEmbedding(64), "pick_place", RolloutConfig())
    path = save_checkpoint(tmp_path / "c.pt", checkpoint)
    payload = torch.load(path, weights_only=True)
    del payload["policy_config"]["object_input"]  # as written before the field existed
    torch.save(payload, path)
    assert load_checkpoint(path).policy.config.object_input is False
    payload["policy_config"]["telepathy"] = 1
    torch.save(payload, path)
    with pytest.raises(ValueError, match="its policy_config does not fit this simstream version's Vision"):
        load_checkpoint(path)


def test_a_checkpoint_of_an_estimating_policy_round_trips(tmp_path):
    policy, data = _fitted_estimating_policy()
    policy.eval()
    checkpoint = PolicyCheckpoint(policy, HashedTextEmbedding(64), "pick_place", RolloutConfig())
    loaded = load_checkpoint(save_checkpoint(tmp_path / "c.pt", checkpoint)).policy
    assert loaded.config.object_input and torch.equal(loaded.offset_std, policy.offset_std)
    assert torch.equal(loaded.eval()(*data.inputs()), policy(*data.inputs()))


# ------------------------------------------------------------------------------------- training precision
def test_precision_auto_is_bfloat16_for_a_vision_trainer_on_a_cpu_with_native_bfloat16(monkeypatch):
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    auto = DemoConfig(vision=True, precision="auto").training_dtype
    assert auto == (torch.bfloat16 if native else torch.float32)
    assert DemoConfig(precision="auto").training_dtype == torch.float32  # the state policy's MLP: float32
    assert DemoConfig(vision=True).training_dtype == torch.float32  # the default
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert DemoConfig(vision=True, precision="auto").training_dtype == torch.float32
    with pytest.raises(ValueError, match=r"DemoConfig\.precision must be 'float32' or 'auto' on this CPU"):
        DemoConfig(vision=True, precision="bfloat16")


def test_a_bfloat16_training_step_keeps_the_loss_and_the_gradients_in_float32():
    from simstream.bc.train import _loss

    data = vision_context_batch(_context_batch(torch.Generator().manual_seed(0)), H, _instructions(), CAMERAS,
                                objects=True)  # fmt: skip
    policy = _policy(object_dim=OBJECT_DIM)
    exact = _loss(policy, data, 1.0, torch.autocast("cpu", enabled=False))
    torch.manual_seed(0)
    policy.train()
    fast = _loss(policy, data, 1.0, torch.autocast("cpu", dtype=torch.bfloat16))
    assert fast.dtype == torch.float32 and torch.isfinite(fast)
    fast.backward()
    assert all(p.grad.dtype == torch.float32 for p in policy.parameters() if p.grad is not None)
    assert policy.encoders["wrist"].convs[0].weight.grad.abs().sum() > 0
    assert abs(fast.item() - exact.item()) < 0.1 * exact.item()  # bfloat16 rounding, the same loss


# ---------------------------------------------------------------------------------------- policy, batch
def test_vision_batch_splits_at_the_anchor_and_zeroes_padding():
    batch = _context_batch(torch.Generator().manual_seed(0))
    data = vision_context_batch(batch, H, _instructions(), CAMERAS)
    assert data.images["front"].shape == (B, H, 3, S, S) and data.images["front"].dtype == torch.uint8
    assert data.targets.shape == (B, F, 8) and data.loss_mask.shape == (B, F) and data.text.shape == (B, 64)
    assert not data.history_mask[0, 0] and data.proprio[0, 0].abs().sum() == 0
    assert data.images["wrist"][0, 0].sum() == 0
    assert torch.equal(data.targets[:, :, 7], batch["actions"][:, H - 1 :, 7])  # gripper stays absolute


def test_policy_output_ignores_padded_history_frames():
    batch = _context_batch(torch.Generator().manual_seed(0))
    data = vision_context_batch(batch, H, _instructions(), CAMERAS)
    policy = _policy()
    policy.eval()
    changed = {camera: frames.clone() for camera, frames in data.images.items()}
    changed["front"][0, 0] = 200  # a padded frame
    proprio = data.proprio.clone()
    proprio[0, 0] = 5.0
    original = policy(data.images, data.proprio, data.history_mask, data.text)
    # padding is masked: the encoders see it, the head multiplies it by 0
    assert torch.allclose(original[0], policy(changed, proprio, data.history_mask, data.text)[0])
    chunk = policy.act(data.images, data.proprio, data.history_mask, data.text)
    assert chunk.shape == (B, F, 8)


def test_vision_checkpoint_round_trip(tmp_path):
    policy = _policy()
    policy.proprio_mean.fill_(0.5)
    checkpoint = PolicyCheckpoint(policy, HashedTextEmbedding(64), "pick_place", RolloutConfig())
    loaded = load_checkpoint(save_checkpoint(tmp_path / "c.pt", checkpoint))
    assert isinstance(loaded.policy, VisionPolicy) and loaded.policy.config == policy.config
    assert torch.equal(loaded.policy.proprio_mean, policy.proprio_mean)


def test_vision_checkpoint_with_the_auxiliary_head_round_trips(tmp_path):
    policy = _policy(object_dim=OBJECT_DIM)
    policy.object_std.fill_(0.25)
    checkpoint = PolicyCheckpoint(policy, HashedTextEmbedding(64), "pick_place", RolloutConfig())
    loaded = load_checkpoint(save_checkpoint(tmp_path / "c.pt", checkpoint))
    assert loaded.policy.config.object_dim == OBJECT_DIM
    assert torch.equal(loaded.policy.object_std, policy.object_std)


def test_load_checkpoint_rejects_an_unknown_policy_kind(tmp_path):
    checkpoint = PolicyCheckpoint(_policy(), HashedTextEmbedding(64), "pick_place", RolloutConfig())
    path = save_checkpoint(tmp_path / "c.pt", checkpoint)
    payload = torch.load(path, weights_only=True)
    payload["policy_kind"] = "telepathy"
    torch.save(payload, path)
    with pytest.raises(ValueError, match="unknown policy_kind 'telepathy'"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_size": 8}, "DemoConfig.image_size must be an int in [16, 256], got 8"),
        ({"image_size": 64, "shift": 17}, "DemoConfig.shift must be an int in [0, 16], got 17"),
        ({"channels": 4}, "DemoConfig.channels must be an int in [8, 512], got 4"),
        ({"channels": 100_000}, "DemoConfig.channels must be an int in [8, 512], got 100000"),
        ({"hidden": 10_000_000}, "DemoConfig.hidden must be an int in [8, 8192], got 10000000"),
        ({"cameras": ()}, "DemoConfig.cameras must be one or more distinct cameras of"),
        ({"cameras": ("front", "front")}, "DemoConfig.cameras must be one or more distinct cameras of"),
        ({"cameras": ("back",)}, "got ('back',)"),
        ({"device": "tpu"}, "DemoConfig.device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ({"device": "cuda:99"}, "DemoConfig.device must be an available device"),
        ({"object_aux_weight": -0.5}, "DemoConfig.object_aux_weight must be"),
        ({"action_noise": 1.0}, "DemoConfig.action_noise must be"),
        ({"object_aux_weight": float("nan")}, "DemoConfig.object_aux_weight must be"),
        ({"object_input": 1}, "DemoConfig.object_input must be a bool, got 1"),
        (
            {"object_aux_weight": 0.0, "object_input": True},
            "DemoConfig.object_input must be False when object_aux_weight is 0 (the estimate needs its loss)",
        ),
        ({"precision": "fp8"}, "DemoConfig.precision must be 'float32', 'bfloat16' or 'auto', got 'fp8'"),
    ],
)
def test_demo_config_rejects_bad_vision_settings(kwargs, message):
    with pytest.raises(ValueError) as error:
        DemoConfig(vision=True, **kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_size": 600}, "VisionPolicyConfig.image_size must be an int in [16, 512], got 600"),
        ({"keypoints": 0}, "VisionPolicyConfig.keypoints must be an int in [1, 1024], got 0"),
        ({"channels": 513}, "VisionPolicyConfig.channels must be an int in [8, 512], got 513"),
        ({"shift": -1}, "VisionPolicyConfig.shift must be an int in [0, 16], got -1"),
        ({"cameras": ("side",)}, "VisionPolicyConfig.cameras must be a nonempty tuple of distinct cameras"),
        ({"object_dim": 3}, "VisionPolicyConfig.object_dim must be 0 (no auxiliary head) or 9"),
        ({"object_input": True}, "VisionPolicyConfig.object_input must be False unless object_dim is 9"),
        ({"object_dim": 9, "object_input": 1}, "VisionPolicyConfig.object_input must be a bool, got 1"),
    ],
)
def test_vision_policy_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError) as error:
        VisionPolicyConfig(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_size": 8}, "CameraSourceSpec.image_size must be an int in [16, 512], got 8"),
        ({"cameras": ("front", "nose")}, "CameraSourceSpec.cameras must be a nonempty tuple of distinct"),
        ({"max_episode_steps": 0}, "CameraSourceSpec.max_episode_steps must be an int >= 1, got 0"),
        ({"action_noise": -0.1}, "CameraSourceSpec.action_noise must be"),
        ({"action_noise": 0.6}, "CameraSourceSpec.action_noise must be"),
    ],
)
def test_camera_source_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError) as error:
        CameraSourceSpec(**kwargs)
    assert message in str(error.value)


def test_vision_preset_then_quick_preset():
    cfg = DemoConfig().with_vision()
    assert cfg.vision and cfg.num_workers == 1 and isinstance(cfg.policy_config, VisionPolicyConfig)
    assert cfg.policy_config.object_input and cfg.object_aux_weight == 1.0 and cfg.ema_decay == 0.9995
    quick = cfg.with_quick()
    assert quick.quick and quick.steps == 60 and quick.batch_size == 32 and quick.eval_episodes == 4
    assert DemoConfig().with_quick().steps == 150  # the state preset is unchanged


# ------------------------------------------------------------------------------------------- prefetcher
def test_prefetcher_hands_batches_in_order_and_raises_the_samplers_error():
    items = iter([1, 2])

    def make_batch():
        value = next(items, None)
        if value is None:
            raise LookupError("no more batches")
        return value

    prefetcher = BatchPrefetcher(make_batch)
    try:
        assert [prefetcher.get(30)[0] for _ in range(2)] == [1, 2]
        with pytest.raises(LookupError, match="no more batches"):
            prefetcher.get(30)
    finally:
        prefetcher.close()


def test_prefetcher_get_is_bounded():
    release = threading.Event()
    prefetcher = BatchPrefetcher(lambda: release.wait(30))
    try:
        with pytest.raises(TimeoutError, match="no training batch after"):
            prefetcher.get(0.2)
    finally:
        release.set()
        prefetcher.close()


# ------------------------------------------------------------------------ perturbed demonstrations (DART)
def _executed_and_recorded(action_noise: float, seed: int = 11):
    from simstream.bc.camera_source import CameraEpisodeSource

    spec = CameraSourceSpec("pick_place", ("front",), image_size=S, max_episode_steps=120,
                            action_noise=action_noise)  # fmt: skip
    source = CameraEpisodeSource(spec, worker_index=0, seed=0)
    executed, step = [], source.env.step

    def spy(action):
        executed.append(action.copy())
        return step(action)

    source.env.step = spy
    try:
        episode = source.record(seed)
    finally:
        source.env.close()
    recorded = source._buffers["actions"][: episode.length].copy()
    states = source._buffers["obs/state"][: episode.length].copy()
    return torch.from_numpy(np.stack(executed)), torch.from_numpy(recorded), torch.from_numpy(states)


def test_action_noise_perturbs_what_the_robot_executes_and_records_the_experts_command():
    executed, recorded, _ = _executed_and_recorded(0.03)
    difference = executed - recorded
    assert torch.equal(difference[:, 7], torch.zeros(len(difference)))  # the gripper is not perturbed
    noise = difference[:, :7]
    assert abs(noise.std().item() - 0.03) < 0.005 and abs(noise.mean().item()) < 0.005
    # the same seed gives the same noise: the perturbed episode is reproducible
    again, recorded_again, _ = _executed_and_recorded(0.03)
    assert torch.equal(again, executed) and torch.equal(recorded_again, recorded)


def test_without_action_noise_the_robot_executes_the_recorded_command():
    executed, recorded, states = _executed_and_recorded(0.0)
    assert torch.equal(executed, recorded)
    _, _, perturbed_states = _executed_and_recorded(0.03)
    length = min(len(states), len(perturbed_states))
    assert not torch.equal(states[:length], perturbed_states[:length])  # the noise moved the robot


def test_camera_episodes_label_each_frame_with_the_phase_that_acted():
    """As the task source's: a frame where the expert ends a phase belongs to that phase's segment (the
    gripper is open while reaching, closed through grasp and lift)."""
    from simstream.bc.camera_source import CameraEpisodeSource
    from simstream.tasks.base import Phase

    spec = CameraSourceSpec("pick_place", ("front",), image_size=S, max_episode_steps=120)
    source = CameraEpisodeSource(spec, worker_index=0, seed=0)
    try:
        for seed in (11, 12):
            episode = source.record(seed)
            gripper = source._buffers["actions"][: episode.length, 7]
            texts = [segment.instruction.split()[0] for segment in episode.segments]
            assert texts[:3] == [Phase.REACH.value, Phase.GRASP.value, Phase.LIFT.value]
            for text, segment in zip(texts, episode.segments):
                commands = set(gripper[segment.start : segment.end].tolist())
                if text == Phase.REACH.value:
                    assert commands == {1.0}, (seed, segment)
                elif text in (Phase.GRASP.value, Phase.LIFT.value):
                    assert commands == {0.0}, (seed, segment)
    finally:
        source.env.close()


# ----------------------------------------------------------------------------- through the real engine
def test_camera_frames_stream_through_the_engine_into_the_policy():
    from simstream import OnlineDataEngine, OnlineDataEngineCfg

    spec = CameraSourceSpec("pick_place", CAMERAS, image_size=S, max_episode_steps=120)
    assert spec.fields()[image_key("wrist")].dtype == torch.uint8
    cfg = OnlineDataEngineCfg(source=spec, buffer_size=2, num_workers=1, seed=3)
    with OnlineDataEngine(cfg) as engine:
        batch = engine.sample_batch_with_context(
            8, H, F, generator=torch.Generator().manual_seed(0), keys=policy_keys(CAMERAS)
        )
        assert ("obs", "objects") not in batch.keys(True)  # never copied for the trainer
        for camera in CAMERAS:
            frames = batch["obs", "images", camera]
            assert frames.shape == (8, H + F - 1, 3, S, S) and frames.dtype == torch.uint8
            anchors = frames[:, H - 1]
            assert anchors.float().std() > 0  # rendered, not blank
        # the front and wrist views differ: two cameras, not one image twice
        assert not torch.equal(batch["obs", "images", "front"], batch["obs", "images", "wrist"])
        instructions = InstructionTable(engine.language_registry, HashedTextEmbedding(64))
        data = vision_context_batch(batch, H, instructions, CAMERAS)
    policy = _policy()
    policy.fit_normalizer(data.proprio, data.history_mask, data.targets, data.loss_mask)
    loss = policy(*data.inputs()).pow(2).mean()
    loss.backward()
    assert all(p.grad is not None for p in policy.encoders.parameters() if p.requires_grad)
