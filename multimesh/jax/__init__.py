"""multimesh's public JAX API (the API of the original library, NVIDIA's multimesh-jax)."""

from multimesh._src.caches import CacheInfo as CacheInfo
from multimesh._src.caches import CachesInfo as CachesInfo
from multimesh._src.caches import cache_info as cache_info
from multimesh._src.caches import clear_caches as clear_caches
from multimesh._src.errors import MultimeshError as MultimeshError
from multimesh._src.errors import MultimeshWarning as MultimeshWarning
from multimesh.jax import errors as errors
from multimesh.jax._analysis.costs import DeviceModel as DeviceModel
from multimesh.jax._analysis.costs import ScheduleComparison as ScheduleComparison
from multimesh.jax._analysis.costs import StepProfile as StepProfile
from multimesh.jax._analysis.costs import compare_schedules as compare_schedules
from multimesh.jax._analysis.costs import residual_bytes as residual_bytes
from multimesh.jax._analysis.costs import xla_costs as xla_costs
from multimesh.jax._analysis.visualize import visualize_schedule as visualize_schedule
from multimesh.jax._contexts import autoshard as autoshard
from multimesh.jax._contexts import context as context
from multimesh.jax._contexts import enable_fast_path as enable_fast_path
from multimesh.jax._contexts import enable_recomputation as enable_recomputation
from multimesh.jax._contexts import ignore_transforms as ignore_transforms
from multimesh.jax._microbatch import microbatch as microbatch
from multimesh.jax._multimesh import MultiMesh as MultiMesh
from multimesh.jax._parallelize import parallelize as parallelize
from multimesh.jax._planner import Cluster as Cluster
from multimesh.jax._planner import ClusterPlan as ClusterPlan
from multimesh.jax._planner import PipelinePlan as PipelinePlan
from multimesh.jax._planner import StageComparison as StageComparison
from multimesh.jax._planner import Transformer as Transformer
from multimesh.jax._planner import plan_cluster as plan_cluster
from multimesh.jax._planner import plan_pipeline as plan_pipeline
from multimesh.jax._planner import transformer_loss as transformer_loss
from multimesh.jax._registrations import Context as Context
from multimesh.jax._registrations import clear_tasks as clear_tasks
from multimesh.jax._registrations import register_task as register_task
from multimesh.jax._registrations import tasks as tasks
from multimesh.jax._results import ParallelizeResult as ParallelizeResult
from multimesh.jax._shardy_mpmd import compile_mpmd as compile_mpmd
from multimesh.jax._stages import handlers as _handlers
from multimesh.jax._stages.mjit import mjit as mjit
from multimesh.jax._task import Task as Task
from multimesh.jax._task import TaskMesh as TaskMesh
from multimesh.jax._task import with_sharding_constraint as with_sharding_constraint
from multimesh.jax._task_dispatch import task as task


def _flax_handler() -> _handlers.ArgumentHandler:
    """The flax wing's handler, imported the first time a question needs it (this
    package's modules never import the wing; only this composition root names it)."""
    # local: flax is optional; the wing loads when a flax argument or task appears
    from multimesh.jax.flax._handler import HANDLER

    return HANDLER


_handlers.register(_flax_handler, arguments=("flax.nnx",),
                   tasks=("flax.linen.Module", "flax.nnx.Module"))
