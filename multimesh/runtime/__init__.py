"""Compile fragments on their submeshes and run an MPMD plan with stock JAX."""

from multimesh.runtime.executor import Executor
from multimesh.runtime.plan import Fragment, Plan, Transfer, build_plan

__all__ = ["Fragment", "Plan", "Transfer", "build_plan", "Executor"]
