"""Models shared by the benchmarks: the package's own built-in models.

    from benchmarks.models import convnet, mlp
    model = convnet(width=0.125)   # a narrow net for quick runs
"""

from multigpu.bench.models import convnet, mlp

__all__ = ["convnet", "mlp"]
