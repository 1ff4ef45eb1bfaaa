"""tokenfair operator: TenantQuota and SchedulingPolicy objects -> the sidecars' config document.

The Kopf handlers live in :mod:`tokenfair_operator.handlers` (``kopf run -m
tokenfair_operator.handlers``); importing this package does not register them. The pure parts
below are what tests and other tools call directly.
"""

from .budgets import split_budgets
from .conditions import Check, conditions_for
from .model import PolicyView, QuotaView, configmap_name, secret_name
from .render import KeyProblem, Rendering, Verdict, render_config
from .status import policy_status, quota_status

__all__ = [
    "Check",
    "KeyProblem",
    "PolicyView",
    "QuotaView",
    "Rendering",
    "Verdict",
    "conditions_for",
    "configmap_name",
    "policy_status",
    "quota_status",
    "render_config",
    "secret_name",
    "split_budgets",
]
