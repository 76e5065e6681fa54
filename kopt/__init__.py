"""kopt: a graph-rewriting optimizer for PyTorch inference.

    optimized = kopt.optimize(model, args, kwargs)        # or torch.compile(model, backend="kopt")
    out = optimized(*args, **kwargs)
    print(optimized.report)
"""

from kopt.api import OptimizedModule, Report, optimize
from kopt.errors import CaptureError, KoptError
from kopt.passes import FP8Config, PassConfig, PassResult
from kopt.verify import VerifyOptions

__all__ = [
    "CaptureError",
    "FP8Config",
    "KoptError",
    "OptimizedModule",
    "PassConfig",
    "PassResult",
    "Report",
    "VerifyOptions",
    "optimize",
]
__version__ = "0.1.0"
