"""planner: make PyTorch training fit a memory budget with the least recomputation.

>>> import planner
>>> sorted(n for n in planner.__all__ if not n[0].isupper())
['apply', 'explain', 'optimize', 'parse_budget', 'plan']
"""

from .api import OptimizedModule, apply, optimize, plan
from .budget import parse_budget
from .errors import InfeasibleBudgetError, PlannerError
from .explain import explain
from .plan import Plan

__all__ = ["optimize", "plan", "apply", "explain", "OptimizedModule", "Plan", "PlannerError",
           "InfeasibleBudgetError", "parse_budget"]
__version__ = "0.1.0"
