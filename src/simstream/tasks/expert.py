"""The scripted expert shared by all tasks: a Cartesian waypoint state machine driving DLS IK.

Phases (each one segment of the episode): reach above the cube and descend around it with the yaw aligned
to the cube (modulo a quarter turn), grasp (close and wait), lift, then place: carry above the task's
release point, lower, open, retreat. The commanded TCP moves towards the active waypoint at a bounded
speed and the IK turns it into joint targets, so the actions are smooth and the robot follows them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .base import CUBE_HALF, Phase, quarter_turn
from .ik import DampedLeastSquaresIK, top_down_rotation
from .scene import CONTROL_DT

if TYPE_CHECKING:
    from .env import TaskEnv

__all__ = ["ScriptedExpert"]

CARRY_HEIGHT = 0.20
"""TCP height (m) while lifting and carrying: clear of the bin rim and the other cubes."""
PREGRASP = 0.10
"""Height (m) above the cube centre where the descent starts."""
FAST, LIFT, SLOW = 0.6, 0.4, 0.25
"""TCP speed limits (m/s): free space, lifting a cube, near contact."""
YAW_RATE = 2.0
"""Yaw speed limit (rad/s)."""
HELD_DISTANCE = 0.03
"""A cube further than this (m) from the TCP after grasping has been dropped: start over."""


class ScriptedExpert:
    """Computes the next action of ``env``'s current episode from the simulated state.

    Owns the state machine (``phase``, stage, timers) and the commanded pose; stateless between
    episodes after :meth:`reset`. Deterministic: the same physics gives the same actions.

    ``acting_phase`` is the phase whose rule computed the last action: label a frame with it, not with
    ``phase``, which an :meth:`act` that ends a phase has already moved on (its action still belongs to
    the phase it ended).
    """

    def __init__(self, env: TaskEnv) -> None:
        self.env = env
        self.scene = env.scene
        self.ik = DampedLeastSquaresIK(self.scene.model)
        self.phase = self.acting_phase = Phase.REACH

    def reset(self) -> None:
        """Start a new episode from the current (just reset) state of the env."""
        mat = self.scene.tcp_mat()
        self.phase, self.stage, self.timer = Phase.REACH, 0, 0
        self.acting_phase = Phase.REACH
        self.pos_cmd = self.scene.tcp_pos()
        self.yaw_cmd = math.atan2(mat[1, 0], mat[0, 0])
        self.q_cmd = self.scene.arm_q()
        self.grip = 1.0
        self.hold: np.ndarray | None = None
        self.place_yaw = 0.0

    def act(self) -> np.ndarray:
        """The action for the current state: float32 ``[8]`` (7 joint targets, gripper in [0, 1])."""
        target, speed, yaw = self._waypoint()
        delta = target - self.pos_cmd
        distance = float(np.linalg.norm(delta))
        max_step = speed * CONTROL_DT
        self.pos_cmd = target.copy() if distance <= max_step else self.pos_cmd + delta * (max_step / distance)
        turn = yaw - self.yaw_cmd
        self.yaw_cmd += float(np.clip(turn, -YAW_RATE * CONTROL_DT, YAW_RATE * CONTROL_DT))
        self.q_cmd = self.ik.solve(self.q_cmd, self.pos_cmd, top_down_rotation(self.yaw_cmd))
        self.timer += 1
        return np.concatenate([self.q_cmd, [self.grip]]).astype(np.float32)

    # ------------------------------------------------------------------ state machine
    def _goto(self, phase: Phase) -> None:
        self.phase, self.stage, self.timer = phase, 0, 0
        self.hold = None

    def _arrived(self, target: np.ndarray, tolerance: float) -> bool:
        commanded = float(np.linalg.norm(self.pos_cmd - target)) < 1e-3
        return commanded and float(np.linalg.norm(self.scene.tcp_pos() - target)) < tolerance

    def _hold(self) -> np.ndarray:
        if self.hold is None:
            self.hold = self.pos_cmd.copy()
        return self.hold

    def _waypoint(self) -> tuple[np.ndarray, float, float]:
        """Advance the state machine and return (TCP target, speed limit, yaw target)."""
        cube = self.scene.cube_pos(self.env.goal.subject)
        carrying = self.phase in (Phase.LIFT, Phase.PLACE) and self.stage < 2
        if carrying and float(np.linalg.norm(cube - self.scene.tcp_pos())) > HELD_DISTANCE:
            self._goto(Phase.REACH)  # dropped it: start over
        self.acting_phase = self.phase  # its rule below computes this step's action, even if it moves on
        if self.phase == Phase.REACH:
            return self._reach(cube)
        if self.phase == Phase.GRASP:
            return self._grasp()
        if self.phase == Phase.LIFT:
            return self._lift()
        return self._place(cube)

    def _reach(self, cube: np.ndarray) -> tuple[np.ndarray, float, float]:
        self.grip = 1.0
        yaw = self.scene.cube_yaw(self.env.goal.subject)
        if self.stage == 0:  # above the cube, turning the fingers to its faces
            target = cube + np.array([0.0, 0.0, PREGRASP])
            if self._arrived(target, 0.02) and abs(yaw - self.yaw_cmd) < 0.05:
                self.stage, self.timer = 1, 0
            return target, FAST, yaw
        if self._arrived(cube, 0.008) or self.timer > 30:  # descend around it
            self._goto(Phase.GRASP)
        return cube, SLOW, yaw

    def _grasp(self) -> tuple[np.ndarray, float, float]:
        self.grip = 0.0
        if self.timer >= 6 and self.scene.finger_opening() < 0.5 * CUBE_HALF:
            self._goto(Phase.REACH)  # closed on nothing
        elif self.timer >= 7:
            self._goto(Phase.LIFT)
        return self._hold(), SLOW, self.yaw_cmd

    def _lift(self) -> tuple[np.ndarray, float, float]:
        target = self._hold().copy()
        target[2] = CARRY_HEIGHT
        if self.scene.tcp_pos()[2] > CARRY_HEIGHT - 0.03:
            self._goto(Phase.PLACE)
            _, wanted = self.env.task.release_point(self.scene, self.env.goal)
            held_yaw = self.scene.cube_yaw(self.env.goal.subject)
            turn = 0.0 if wanted is None else quarter_turn(wanted - held_yaw)
            self.place_yaw = self.yaw_cmd + turn
        return target, LIFT, self.yaw_cmd

    def _place(self, cube: np.ndarray) -> tuple[np.ndarray, float, float]:
        point, _ = self.env.task.release_point(self.scene, self.env.goal)
        # Aim the cube, not the TCP, at the release point: the cube may have slipped in the fingers.
        above = point + (self.scene.tcp_pos() - cube)
        if self.stage == 0:  # carry at a safe height
            above[2] = CARRY_HEIGHT
            if self._arrived(above, 0.02) and abs(self.place_yaw - self.yaw_cmd) < 0.03:
                self.stage, self.timer = 1, 0
            return above, FAST, self.place_yaw
        if self.stage == 1:  # lower
            if float(np.linalg.norm(cube - point)) < 0.006 or self.timer > 30:
                self.stage, self.timer = 2, 0
            return above, SLOW, self.place_yaw
        self.grip = 1.0
        hold = self._hold()
        if self.stage == 2:  # open and let go
            if self.timer >= 5:
                self.stage, self.timer, self.hold = 3, 0, None
            return hold, SLOW, self.place_yaw
        return hold + np.array([0.0, 0.0, 0.08]), SLOW, self.place_yaw  # retreat
