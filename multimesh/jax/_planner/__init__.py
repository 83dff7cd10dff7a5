"""The automatic pipeline planner (issue 24): stages, submeshes, microbatches and
schedule chosen from a model's own costs. :mod:`._units` finds and costs the
name-stack units (jax), :mod:`._search` cuts them (no jax), :mod:`._plan` is the
answer (:class:`PipelinePlan`), :mod:`._api` the entry point (:func:`plan_pipeline`).
"""

from multimesh.jax._planner._api import plan_pipeline as plan_pipeline
from multimesh.jax._planner._plan import PipelinePlan as PipelinePlan
from multimesh.jax._planner._plan import Stage as Stage
from multimesh.jax._planner._plan import StageComparison as StageComparison
