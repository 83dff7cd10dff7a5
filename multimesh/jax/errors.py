"""multimesh's error and warning classes, importable by name (as :mod:`jax.errors`).

Every error inherits :class:`MultimeshError` *and* the matching builtin
(``ValueError``, ``TypeError``), so ``except ValueError`` keeps working; every
warning is a :class:`MultimeshWarning` (a ``UserWarning``). ``docs/errors.md``
lists them with the errors each one is raised for.
"""

from multimesh._src.errors import DiagnosticError as DiagnosticError
from multimesh._src.errors import DiagnosticWarning as DiagnosticWarning
from multimesh._src.errors import DonationError as DonationError
from multimesh._src.errors import IRContractError as IRContractError
from multimesh._src.errors import LogicalShardingError as LogicalShardingError
from multimesh._src.errors import MeshError as MeshError
from multimesh._src.errors import MultimeshAttributeError as MultimeshAttributeError
from multimesh._src.errors import MultimeshError as MultimeshError
from multimesh._src.errors import MultimeshTypeError as MultimeshTypeError
from multimesh._src.errors import MultimeshValueError as MultimeshValueError
from multimesh._src.errors import MultimeshWarning as MultimeshWarning
from multimesh._src.errors import PassFailure as PassFailure
from multimesh._src.errors import PassStepError as PassStepError
from multimesh._src.errors import PipelineError as PipelineError
from multimesh._src.errors import SourceError as SourceError
from multimesh.schedules import ScheduleError as ScheduleError
from multimesh.schedules import ScheduleTypeError as ScheduleTypeError
