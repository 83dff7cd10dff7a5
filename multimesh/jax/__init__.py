"""multimesh's public JAX API (MultiMesh-compatible)."""

from multimesh._src.errors import MultimeshError as MultimeshError
from multimesh._src.errors import MultimeshWarning as MultimeshWarning
from multimesh.jax._contexts import autoshard as autoshard
from multimesh.jax._contexts import context as context
from multimesh.jax._contexts import enable_fast_path as enable_fast_path
from multimesh.jax._contexts import enable_recomputation as enable_recomputation
from multimesh.jax._contexts import ignore_transforms as ignore_transforms
from multimesh.jax._microbatch import microbatch as microbatch
from multimesh.jax._mjit import mjit as mjit
from multimesh.jax._mjit import parallelize as parallelize
from multimesh.jax._multimesh import Context as Context
from multimesh.jax._multimesh import MultiMesh as MultiMesh
from multimesh.jax._multimesh import clear_tasks as clear_tasks
from multimesh.jax._multimesh import register_task as register_task
from multimesh.jax._multimesh import tasks as tasks
from multimesh.jax._task import Task as Task
from multimesh.jax._task import TaskMesh as TaskMesh
from multimesh.jax._task import task as task
from multimesh.jax._task import with_sharding_constraint as with_sharding_constraint
from multimesh.jax._visualize import visualize_schedule as visualize_schedule
