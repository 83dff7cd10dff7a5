"""The automatic pipeline planner (issue 24): stages, submeshes, microbatches and
schedule chosen from a model's own costs. :mod:`._units` finds and costs the
name-stack units (jax), :mod:`._search` cuts them (no jax), :mod:`._plan` is the
answer (:class:`PipelinePlan`), :mod:`._api` the entry point (:func:`plan_pipeline`).

The cluster planner (issue 38) plans a described cluster from shapes alone:
:mod:`._cluster` (:class:`Cluster`, the device kinds), :mod:`._transformer` (the
model's shapes and one layer's jaxpr counts), :mod:`._cluster_search` (pricing and
the layout search), :mod:`._cluster_plan` (:func:`plan_cluster`, :class:`ClusterPlan`).
"""

from multimesh.jax._planner._api import plan_pipeline as plan_pipeline
from multimesh.jax._planner._cluster import DEVICE_KINDS as DEVICE_KINDS
from multimesh.jax._planner._cluster import Cluster as Cluster
from multimesh.jax._planner._cluster_plan import ClusterPlan as ClusterPlan
from multimesh.jax._planner._cluster_plan import plan_cluster as plan_cluster
from multimesh.jax._planner._plan import PipelinePlan as PipelinePlan
from multimesh.jax._planner._plan import Stage as Stage
from multimesh.jax._planner._plan import StageComparison as StageComparison
from multimesh.jax._planner._transformer import Transformer as Transformer
from multimesh.jax._planner._transformer import transformer_loss as transformer_loss
