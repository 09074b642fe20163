"""The MuJoCo table-top scene shared by all tasks: model loading, reset, stepping, observations, images.

This is the module that imports MuJoCo; ``simstream.tasks`` imports it only inside worker-side code paths
(``TaskEnv``, ``SourceSpec.build``). ``MUJOCO_GL`` must be chosen before the first ``import mujoco``, so it
defaults to EGL here (headless, no display needed); set it to ``osmesa`` beforehand to use OSMesa.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
# llvmpipe renders small images as fast on one thread and then does not fight the other workers.
os.environ.setdefault("LP_NUM_THREADS", "1")
# Mesa's shader disk cache saves ~70 ms on a process's first render, but its writer thread can hold the
# process's exit for seconds on a busy machine (the kernel waits for its file I/O): producers then miss
# their shutdown bound and are terminated. MESA_SHADER_CACHE_DISABLE=false turns it back on.
os.environ.setdefault("MESA_SHADER_CACHE_DISABLE", "true")

import mujoco
import numpy as np

from .base import COLOURS, CUBE_HALF, GL_BACKEND_FIX, OBJECTS_DIM, STATE_DIM, quarter_turn

__all__ = ["ARM_JOINTS", "CONTROL_DT", "HOME_QPOS", "TabletopScene"]

SCENE_XML = Path(__file__).with_name("scene.xml")
ARM_JOINTS = tuple(f"joint{i}" for i in range(1, 8))
FINGER_JOINTS = ("finger_joint1", "finger_joint2")
HOME_QPOS = np.array([0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785])
CONTROL_DT = 0.05
"""Seconds per control step: 20 Hz, 25 physics steps of 2 ms."""
MAX_OPENING = 0.04
"""Finger travel (m); the gripper command in [0, 1] scales it."""
CUBE_REGION = ((0.36, 0.62), (-0.24, 0.14))
"""x and y ranges (m) of the cube centres at reset, clear of the bin."""
MIN_CUBE_GAP = 0.09
"""Smallest distance between cube centres at reset: room for the open fingers."""
ARM_NOISE = 0.04
"""Half-width (rad) of the uniform noise on the home posture at reset."""


class TabletopScene:
    """Owns one ``MjModel``/``MjData`` pair and, lazily, one ``mujoco.Renderer``.

    Physics is read by name (joints, sites, bodies) and every observation is a fresh array, so a caller
    may keep observations across steps. Deterministic: the same reset seed gives bit-identical physics.
    """

    def __init__(self) -> None:
        model = self.model = mujoco.MjModel.from_xml_path(str(SCENE_XML))
        self.data = mujoco.MjData(model)
        self.n_substeps = round(CONTROL_DT / model.opt.timestep)
        self.arm_qpos = np.array([model.joint(n).qposadr[0] for n in ARM_JOINTS])
        self.arm_dofs = np.array([model.joint(n).dofadr[0] for n in ARM_JOINTS])
        self.finger_qpos = np.array([model.joint(n).qposadr[0] for n in FINGER_JOINTS])
        self.joint_low, self.joint_high = model.jnt_range[[model.joint(n).id for n in ARM_JOINTS]].T
        self.cube_qpos = {c: model.joint(f"{c}_cube").qposadr[0] for c in COLOURS}
        self.cube_dofs = {c: model.joint(f"{c}_cube").dofadr[0] for c in COLOURS}
        self.home_key = model.key("home").id
        self._renderer: mujoco.Renderer | None = None
        self._render_size: tuple[int, int] | None = None

    # ------------------------------------------------------------------ simulation
    def reset(self, rng: np.random.Generator) -> None:
        """Home posture with small joint noise; cubes at random non-overlapping poses on the table."""
        model, data = self.model, self.data
        mujoco.mj_resetDataKeyframe(model, data, self.home_key)
        q = HOME_QPOS + rng.uniform(-ARM_NOISE, ARM_NOISE, size=HOME_QPOS.shape)
        data.qpos[self.arm_qpos] = q
        data.ctrl[:7] = q
        for colour, xy in zip(COLOURS, self._cube_positions(rng)):
            yaw = rng.uniform(0.0, math.pi / 2)
            adr = self.cube_qpos[colour]
            data.qpos[adr : adr + 3] = (xy[0], xy[1], CUBE_HALF)
            data.qpos[adr + 3 : adr + 7] = (math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))
        mujoco.mj_forward(model, data)

    @staticmethod
    def _cube_positions(rng: np.random.Generator) -> list[np.ndarray]:
        (x0, x1), (y0, y1) = CUBE_REGION
        while True:  # rejection sampling; the region fits three cubes in almost every draw
            xy = rng.uniform((x0, y0), (x1, y1), size=(len(COLOURS), 2))
            gaps = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(len(COLOURS))
            if gaps.min() >= MIN_CUBE_GAP:
                return list(xy)

    def apply(self, action: np.ndarray) -> None:
        """Set the 7 joint targets (clipped to the limits) and the gripper command, then advance 50 ms."""
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (8,) or not np.all(np.isfinite(action)):
            raise ValueError(f"action must be 8 finite numbers, got shape {action.shape}: {action!r}")
        self.data.ctrl[:7] = np.clip(action[:7], self.joint_low, self.joint_high)
        self.data.ctrl[7] = MAX_OPENING * float(np.clip(action[7], 0.0, 1.0))
        mujoco.mj_step(self.model, self.data, nstep=self.n_substeps)
        # mj_step computes positions before it integrates: without these, the tool, the cubes and every
        # camera frame read after the step were one 2-ms sub-step older than the joints beside them
        # (mj_kinematics moves the bodies; mj_comPos and mj_camlight the cameras, the wrist's with them)
        mujoco.mj_kinematics(self.model, self.data)
        mujoco.mj_comPos(self.model, self.data)
        mujoco.mj_camlight(self.model, self.data)

    # ------------------------------------------------------------------ reading the physics by name
    def arm_q(self) -> np.ndarray:
        return self.data.qpos[self.arm_qpos].copy()

    def tcp_pos(self) -> np.ndarray:
        return self.data.site("tcp").xpos.copy()

    def tcp_mat(self) -> np.ndarray:
        return self.data.site("tcp").xmat.reshape(3, 3).copy()

    def finger_opening(self) -> float:
        return float(self.data.qpos[self.finger_qpos].mean())

    def cube_pos(self, colour: str) -> np.ndarray:
        return self.data.body(f"{colour}_cube").xpos.copy()

    def cube_quat(self, colour: str) -> np.ndarray:
        return self.data.body(f"{colour}_cube").xquat.copy()

    def cube_yaw(self, colour: str) -> float:
        """Yaw of the cube's most horizontal face normal, wrapped to a quarter turn."""
        axes = self.data.body(f"{colour}_cube").xmat.reshape(3, 3)
        axis = axes[:, int(np.argmin(np.abs(axes[2])))]
        return quarter_turn(math.atan2(axis[1], axis[0]))

    def cube_speed(self, colour: str) -> float:
        dof = self.cube_dofs[colour]
        return float(np.linalg.norm(self.data.qvel[dof : dof + 3]))

    def bin_center(self) -> np.ndarray:
        return self.data.site("bin_center").xpos.copy()

    def bin_inner_half(self) -> float:
        wall = self.model.geom("bin_wall_px")
        return float(wall.pos[0] - wall.size[0])

    def bin_rim_height(self) -> float:
        wall = self.model.geom("bin_wall_px")
        return float(self.data.body("bin").xpos[2] + wall.pos[2] + wall.size[2])

    # ------------------------------------------------------------------ observations
    def state(self) -> np.ndarray:
        """``obs/state`` (float32 [23]); layout in :data:`simstream.tasks.base.STATE_DIM`."""
        quat = np.empty(4)
        mujoco.mju_mat2Quat(quat, self.data.site("tcp").xmat)
        out = np.concatenate(
            [
                self.data.qpos[self.arm_qpos],
                self.data.qvel[self.arm_dofs],
                self.data.qpos[self.finger_qpos],
                self.data.site("tcp").xpos,
                quat,
            ]
        )
        assert out.shape == (STATE_DIM,)
        return out.astype(np.float32)

    def objects(self) -> np.ndarray:
        """``obs/objects`` (float32 [21]): position and quaternion of each cube in colour order."""
        out = np.concatenate([np.concatenate([self.cube_pos(c), self.cube_quat(c)]) for c in COLOURS])
        assert out.shape == (OBJECTS_DIM,)
        return out.astype(np.float32)

    def render(self, camera: str, size: tuple[int, int]) -> np.ndarray:
        """An RGB image ``uint8 [3, H, W]`` from ``camera``; the renderer is created on first use."""
        if self._renderer is None or self._render_size != size:
            self.close()
            self._renderer = self._make_renderer(size)
            self._render_size = size
        self._renderer.update_scene(self.data, camera=camera)
        return np.ascontiguousarray(self._renderer.render().transpose(2, 0, 1))

    def _make_renderer(self, size: tuple[int, int]) -> mujoco.Renderer:
        height, width = size
        vis = self.model.vis.global_
        vis.offwidth, vis.offheight = max(vis.offwidth, width), max(vis.offheight, height)
        try:
            return mujoco.Renderer(self.model, height=height, width=width)
        except Exception as error:
            raise RuntimeError(
                f"cannot create a MuJoCo renderer with MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}: "
                f"{error}. {GL_BACKEND_FIX}, or pass image_size=None for state-only episodes"
            ) from error

    def close(self) -> None:
        """Release the renderer (its GL context); the scene stays usable."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
