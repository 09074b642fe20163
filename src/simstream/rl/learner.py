"""The APPO learner: V-trace targets from a batch of rollouts, then clipped-surrogate epochs (IMPACT).

Owns the actor-critic, its target copy, the optimiser and the observation normaliser; runs in the
learner process only. Every update checks its inputs, its loss and its gradient norm for NaN/Inf.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from torch.distributions import Normal, kl_divergence

from .appo import check_finite, ppo_loss, vtrace
from .config import APPOConfig
from .model import ActorCritic, ObsNormalizer, pack_policy

__all__ = ["BATCH_KEYS", "APPOLearner"]

BATCH_KEYS = ("obs", "actions", "logp", "rewards", "dones", "last_obs")
"""A batch: ``obs [T, B, D]``, ``actions [T, B, A]``, ``logp/rewards/dones [T, B]``, ``last_obs [B, D]``;
optionally ``truncated [T, B]`` (1 where an episode was cut by a time limit, not terminated) with
``final_obs [T, B, D]`` (its last observation there): those rewards get ``gamma * V(final_obs)``."""

_LR_BOUNDS = (1e-5, 1e-2)


class APPOLearner:
    """Owns the networks, the target network, the optimiser and the normaliser.

    Invariant: ``target`` equals the policy as it was ``updates % target_update_interval`` updates ago
    (a hard copy every ``target_update_interval`` updates).
    """

    def __init__(self, cfg: APPOConfig, obs_dim: int, act_dim: int, device: str | torch.device) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = ActorCritic(obs_dim, act_dim, cfg.hidden_sizes, cfg.init_log_std)
        self.model = model.to(self.device)
        self.target = copy.deepcopy(self.model).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.learning_rate, eps=1e-5)
        self.normalizer = ObsNormalizer(obs_dim, cfg.normalize_obs)
        self.target_normalizer = copy.deepcopy(self.normalizer)
        """The statistics the target network was trained under (it is a copy of an older policy)."""
        self.learning_rate = cfg.learning_rate
        self.updates = 0
        self._shuffle = torch.Generator().manual_seed(cfg.seed + 1)

    def snapshot(self) -> torch.Tensor:
        """The flat vector the collector loads: actor, critic and normaliser statistics."""
        return pack_policy(self.model, self.normalizer)

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One update on a time-major batch (see :data:`BATCH_KEYS`); returns averaged metrics."""
        cfg = self.cfg
        keys = BATCH_KEYS + (("truncated", "final_obs") if "truncated" in batch else ())
        for key in keys:
            check_finite(f"batch.{key}", batch[key])
        # Normalised with the statistics the collector acted under: updated first, they would make the
        # target's log-probabilities differ from the behaviour's even in lock-step (rho != 1 at lag 0).
        # The batch joins the statistics after the update, before the next snapshot.
        dev = self.device
        obs = self.normalizer.normalize(batch["obs"]).to(dev)
        last_obs = self.normalizer.normalize(batch["last_obs"]).to(dev)
        actions, behaviour_logp = batch["actions"].to(dev), batch["logp"].to(dev)
        with torch.no_grad():
            values = self.model.value(obs)
            rewards = self._with_timeout_bootstrap(batch)
            # with target_update_interval > 1 the target is an older policy, trained under older statistics
            target_obs = (
                obs
                if self.cfg.target_update_interval == 1
                else self.target_normalizer.normalize(batch["obs"]).to(dev)
            )
            target_dist = self.target.distribution(target_obs)
            target_logp = target_dist.log_prob(actions).sum(-1)
            targets = vtrace(
                behaviour_logp,
                target_logp,
                rewards,
                values,
                self.model.value(last_obs),
                cfg.gamma * (1.0 - batch["dones"].to(dev)),
                rho_bar=cfg.rho_bar,
                c_bar=cfg.c_bar,
                lam=cfg.gae_lambda,
            )
        flat = {
            "obs": obs.flatten(0, 1),
            "actions": actions.flatten(0, 1),
            "behaviour_logp": behaviour_logp.flatten(),
            "target_logp": target_logp.flatten(),
            "target_mean": target_dist.mean.flatten(0, 1),
            "target_std": target_dist.stddev.flatten(0, 1),
            "advantages": targets.advantages.flatten(),
            "vs": targets.vs.flatten(),
        }
        if cfg.desired_kl is not None and cfg.target_update_interval > 1:
            # the step size follows how far this update moved the policy: KL to an older target only
            # grows between refreshes, which pinned the rate to its floor for most updates
            with torch.no_grad():
                start = self.model.distribution(obs)
            flat["start_mean"], flat["start_std"] = start.mean.flatten(0, 1), start.stddev.flatten(0, 1)
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        count = flat["vs"].numel()
        size = min(cfg.minibatch_size, count)
        for _ in range(cfg.num_epochs):
            order = torch.randperm(count, generator=self._shuffle).to(dev)
            for start in range(0, count - size + 1, size):
                parts = self._step({k: v[order[start : start + size]] for k, v in flat.items()})
                for key, value in parts.items():
                    sums[key] += value
                steps += 1
        self.normalizer.update(batch["obs"])
        self.updates += 1
        if self.updates % cfg.target_update_interval == 0:
            self.target.load_state_dict(self.model.state_dict())
            self.target_normalizer.load_state_dict(self.normalizer.state_dict())
        metrics = {key: value / steps for key, value in sums.items()}
        metrics["vtrace/rho_clip_fraction"] = float(targets.rho_clip_fraction)
        metrics["vtrace/rho_p99"] = float(targets.rho_p99)
        metrics["ppo/learning_rate"] = self.learning_rate
        return metrics

    def _with_timeout_bootstrap(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's rewards, each truncated episode's last one plus ``gamma * V(s_T)`` of the current
        critic (a truncated episode did not end: only a termination cuts the return). Computed here, not
        by the collector, whose critic is up to ``max_policy_lag`` versions old in async mode."""
        rewards = batch["rewards"].to(self.device)
        if "truncated" not in batch:
            return rewards
        cut = batch["truncated"].to(self.device) > 0
        if not bool(cut.any()):
            return rewards
        final = self.normalizer.normalize(batch["final_obs"]).to(self.device)[cut]
        rewards = rewards.clone()
        rewards[cut] += self.cfg.gamma * self.model.value(final)
        return rewards

    def _step(self, mb: dict[str, torch.Tensor]) -> dict[str, float]:
        cfg = self.cfg
        dist = self.model.distribution(mb["obs"])
        loss = ppo_loss(
            dist,
            self.model.value(mb["obs"]),
            mb["actions"],
            mb["behaviour_logp"],
            mb["target_logp"],
            Normal(mb["target_mean"], mb["target_std"]),
            mb["advantages"],
            mb["vs"],
            clip_ratio=cfg.clip_ratio,
            value_coef=cfg.value_coef,
            entropy_coef=cfg.entropy_coef,
        )
        # KL(policy at this update's start || current), measured as kl_target is: before the step
        moved = None
        if "start_mean" in mb:  # target_update_interval > 1 (else the target is that start policy)
            with torch.no_grad():
                current = Normal(dist.mean.detach(), dist.stddev.detach())
                moved = float(
                    kl_divergence(Normal(mb["start_mean"], mb["start_std"]), current).sum(-1).mean()
                )
        check_finite("loss", loss.total.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        check_finite("grad_norm", grad_norm)
        self.optimizer.step()
        kl = float(loss.kl_target)
        if cfg.desired_kl is not None:
            self._adapt_learning_rate(kl if moved is None else moved)
        return {
            "loss/policy": float(loss.policy),
            "loss/value": float(loss.value),
            "loss/entropy": float(loss.entropy),
            "ppo/clip_fraction": float(loss.clip_fraction),
            "policy_kl/target_to_current": kl,
            "policy_kl/behavior_to_current": float(loss.kl_behaviour),
            "grad/global_norm": float(grad_norm),
        }

    def _adapt_learning_rate(self, kl: float) -> None:
        low, high = _LR_BOUNDS
        rate = self.learning_rate
        # each move only in its own direction: a start value outside the bounds is never pushed the wrong
        # way (a "raise" clamped to 1e-2 lowered a rate of 5e-2)
        if kl > 2.0 * self.cfg.desired_kl:
            self.learning_rate = min(rate, max(low, rate / 1.5))
        elif 0.0 < kl < 0.5 * self.cfg.desired_kl:
            self.learning_rate = max(rate, min(high, rate * 1.5))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "normalizer": self.normalizer.state_dict(),
            "target_normalizer": self.target_normalizer.state_dict(),
            "learning_rate": self.learning_rate,
            "updates": self.updates,
            "shuffle": self._shuffle.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output, all or nothing: on any error (a missing or malformed entry)
        the learner is left as it was and the error is raised."""
        shuffle = state.get("shuffle")  # checkpoints before it was saved resume with the seed's sequence
        if shuffle is not None:
            # a checkpoint mapped to the learner's device (cuda) moved the generator's state there, which
            # set_state refuses: on the CPU, and checked before anything is restored (no half-restored runner)
            shuffle = shuffle.cpu()
            torch.Generator().set_state(shuffle)
        previous = copy.deepcopy(self.state_dict())
        try:
            self._restore(state, shuffle)
        except BaseException as error:
            try:
                self._restore(previous, previous["shuffle"])
            except BaseException as undo:
                error.add_note(f"and putting the learner back failed too ({type(undo).__name__}: {undo})")
            raise

    def _restore(self, state: dict, shuffle: torch.Tensor | None) -> None:
        learning_rate, updates = float(state["learning_rate"]), int(state["updates"])
        self.model.load_state_dict(state["model"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.normalizer.load_state_dict(state["normalizer"])
        self.target_normalizer.load_state_dict(state.get("target_normalizer", state["normalizer"]))
        self.learning_rate, self.updates = learning_rate, updates
        if shuffle is not None:
            self._shuffle.set_state(shuffle)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
