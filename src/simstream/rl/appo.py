"""Pure functions of async PPO: V-trace targets, the IMPACT surrogate loss and the NaN guard.

Nothing here knows about processes; every function is testable on hand-made tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributions import Normal, kl_divergence

__all__ = ["NonFiniteError", "PPOLoss", "VTrace", "check_finite", "ppo_loss", "vtrace"]


class NonFiniteError(FloatingPointError):
    """A tensor that must be finite holds NaN or Inf; the message names the tensor."""


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` when ``tensor`` holds NaN or Inf (data is never altered).

    Examples:
        >>> check_finite("rewards", torch.ones(3))
    """
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()
    first = tuple(bad[0].tolist())
    raise NonFiniteError(
        f"non-finite values in {name!r}: {bad.shape[0]} of {tensor.numel()} entries "
        f"(first at index {first}: {tensor[first].item()!r})"
    )


@dataclass(frozen=True)
class VTrace:
    """V-trace targets for a ``[T, B]`` batch."""

    vs: torch.Tensor
    """Value targets ``v_s``."""
    advantages: torch.Tensor
    """Policy-gradient advantages ``rho_s * (r_s + gamma_s * v_{s+1} - V(x_s))``."""
    rho_clip_fraction: torch.Tensor
    rho_p99: torch.Tensor


def vtrace(
    behaviour_logp: torch.Tensor,
    target_logp: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    discounts: torch.Tensor,
    *,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> VTrace:
    """V-trace (Espeholt et al. 2018) with a trace decay ``lam``; inputs are time-major ``[T, B]``.

    With ``rho_t = min(rho_bar, pi/mu)``, ``c_t = lam * min(c_bar, pi/mu)``,
    ``delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))``:
    ``v_t - V(x_t) = delta_t + gamma_t c_t (v_{t+1} - V(x_{t+1}))``. ``discounts`` is ``gamma * (1 - done)``
    so nothing flows across an episode end. On-policy (``pi == mu``) ``v_t - V(x_t)`` is GAE(lam); the
    policy advantage ``rho_t (r_t + gamma_t v_{t+1} - V(x_t))`` is IMPALA's, not GAE(lam) (its next-step
    correction is not decayed by ``lam``).

    The backward recursion runs on the tensors' device (``T`` small kernels, no host synchronisation).
    """
    with torch.no_grad():
        log_rhos = target_logp - behaviour_logp
        raw_rhos = log_rhos.exp()
        rhos = raw_rhos.clamp(max=rho_bar)
        cs = lam * raw_rhos.clamp(max=c_bar)
        next_values = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
        deltas = rhos * (rewards + discounts * next_values - values)
        corrections = torch.zeros_like(values)
        carry = torch.zeros_like(bootstrap_value)
        for t in range(values.shape[0] - 1, -1, -1):
            carry = deltas[t] + discounts[t] * cs[t] * carry
            corrections[t] = carry
        vs = values + corrections
        next_vs = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
        advantages = rhos * (rewards + discounts * next_vs - values)
        return VTrace(
            vs=vs,
            advantages=advantages,
            rho_clip_fraction=(raw_rhos > rho_bar).float().mean(),
            rho_p99=torch.quantile(raw_rhos.flatten().float()[:100_000], 0.99),
        )


@dataclass(frozen=True)
class PPOLoss:
    """The total loss to minimise and its parts (detached metrics except ``total``)."""

    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    clip_fraction: torch.Tensor
    kl_behaviour: torch.Tensor
    """Estimated KL(behaviour || current) on the minibatch."""
    kl_target: torch.Tensor
    """Analytic KL(target || current), averaged over the minibatch."""


def ppo_loss(
    dist: Normal,
    values: torch.Tensor,
    actions: torch.Tensor,
    behaviour_logp: torch.Tensor,
    target_logp: torch.Tensor,
    target_dist: Normal,
    advantages: torch.Tensor,
    value_targets: torch.Tensor,
    *,
    clip_ratio: float,
    value_coef: float,
    entropy_coef: float,
) -> PPOLoss:
    """IMPACT surrogate (Luo et al. 2020): a clipped PPO objective anchored at the target network.

    ``ratio = pi_theta / pi_target``, clipped to ``1 +- clip_ratio``: the trust region is around the target
    policy, not the behaviour policy, so data a version or two old still moves the policy by a full step.
    The off-policy correction is applied once, inside ``advantages`` (V-trace's truncated
    ``rho = min(rho_bar, pi_target / mu)``). Advantages are normalised per minibatch.
    """
    logp = dist.log_prob(actions).sum(-1)
    log_ratio = logp - target_logp
    ratio = log_ratio.exp()
    adv = (advantages - advantages.mean()) / (advantages.std(unbiased=False) + 1e-8)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv)
    policy_loss = -surrogate.mean()
    value_loss = 0.5 * (values - value_targets).square().mean()
    entropy = dist.entropy().sum(-1).mean()
    total = policy_loss + value_coef * value_loss - entropy_coef * entropy
    with torch.no_grad():
        behaviour_ratio = (logp - behaviour_logp).exp()
        kl_behaviour = ((behaviour_ratio - 1) - (logp - behaviour_logp)).mean()
        kl_target = kl_divergence(target_dist, dist).sum(-1).mean()
        clip_fraction = ((ratio - 1).abs() > clip_ratio).float().mean()
    return PPOLoss(
        total=total,
        policy=policy_loss.detach(),
        value=value_loss.detach(),
        entropy=entropy.detach(),
        clip_fraction=clip_fraction,
        kl_behaviour=kl_behaviour,
        kl_target=kl_target,
    )
