"""Compile fragments on their submeshes and run an MPMD plan with stock JAX."""

from multimesh.runtime.plan import Fragment, Plan, Transfer, build_plan
from multimesh.runtime.executor import Executor

__all__ = ["Fragment", "Plan", "Transfer", "build_plan", "Executor"]
