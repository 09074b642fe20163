"""Damped-least-squares inverse kinematics for the arm's TCP on a scratch ``MjData``."""

from __future__ import annotations

import math
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco
import numpy as np

from .scene import ARM_JOINTS, HOME_QPOS

__all__ = ["DampedLeastSquaresIK", "top_down_rotation"]


def top_down_rotation(yaw: float) -> np.ndarray:
    """TCP orientation pointing the fingers straight down, the hand's x axis at ``yaw`` (world z)."""
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, s, 0.0], [s, -c, 0.0], [0.0, 0.0, -1.0]])


class DampedLeastSquaresIK:
    """Joint targets that put the ``tcp`` site at a 6-D pose.

    Owns a scratch ``MjData`` so solving never touches the simulated state. Each iteration applies
    ``dq = J^T (J J^T + damping^2 I)^-1 e + (I - J^+ J) k (q_home - q)``, with ``e`` the position error
    and the rotation error (rad), clipped to the joint limits; the null-space term pulls the redundant
    degree of freedom towards the home posture.
    """

    def __init__(
        self,
        model: mujoco.MjModel,
        *,
        iterations: int = 2,
        damping: float = 0.05,
        nullspace_gain: float = 0.1,
    ) -> None:
        self.model = model
        self.data = mujoco.MjData(model)
        self.iterations = iterations
        self.damping = damping
        self.nullspace_gain = nullspace_gain
        self.site = model.site("tcp").id
        self.qpos = np.array([model.joint(n).qposadr[0] for n in ARM_JOINTS])
        self.dofs = np.array([model.joint(n).dofadr[0] for n in ARM_JOINTS])
        self.low, self.high = model.jnt_range[[model.joint(n).id for n in ARM_JOINTS]].T
        self._jacp = np.zeros((3, model.nv))
        self._jacr = np.zeros((3, model.nv))
        self._damping_eye = damping**2 * np.eye(6)
        self._eye = np.eye(len(self.qpos))

    def solve(self, q: np.ndarray, pos: np.ndarray, rot: np.ndarray) -> np.ndarray:
        """Refine joint angles ``q`` (7) towards TCP position ``pos`` and rotation matrix ``rot``."""
        q = np.array(q, dtype=np.float64)
        model, data = self.model, self.data
        for _ in range(self.iterations):
            data.qpos[self.qpos] = q
            mujoco.mj_kinematics(model, data)
            mujoco.mj_comPos(model, data)
            current = data.site_xmat[self.site].reshape(3, 3)
            # 0.5 * sum_i current[:, i] x rot[:, i], via its skew matrix rot @ current.T - current @ rot.T
            skew = rot @ current.T - current @ rot.T
            twist = 0.5 * np.array([skew[2, 1], skew[0, 2], skew[1, 0]])
            error = np.concatenate([pos - data.site_xpos[self.site], twist])
            mujoco.mj_jacSite(model, data, self._jacp, self._jacr, self.site)
            jac = np.vstack([self._jacp[:, self.dofs], self._jacr[:, self.dofs]])
            inverse = jac.T @ np.linalg.inv(jac @ jac.T + self._damping_eye)
            pull = self.nullspace_gain * (HOME_QPOS - q)
            q = np.clip(q + inverse @ error + (self._eye - inverse @ jac) @ pull, self.low, self.high)
        return q
