"""`gerl plan`: predicted peak GPU memory per role, computed on a CPU without allocating any weights (docs/plan.md).

    from gerl.plan import plan_for_config, format_plan
    plan = plan_for_config(cfg)          # MemoryPlan: roles, resident lines, phases, card verdicts
    print(format_plan(plan))             # the table `gerl plan` prints
    plan.peak_gib("actor")               # GiB; plan.metrics() → {"plan_peak_gib/actor": …, …}
"""

from gerl.plan.planner import CARDS, MemoryPlan, RolePlan, plan_for_config, role_names
from gerl.plan.report import format_plan

__all__ = ["CARDS", "MemoryPlan", "RolePlan", "format_plan", "plan_for_config", "role_names"]
