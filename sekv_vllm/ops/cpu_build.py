"""The build of sekv's C++ kernels (`csrc/cpu/*.cpp`): compiled on first use with torch's C++ extension
builder (g++, OpenMP), cached under TORCH_EXTENSIONS_DIR."""
from __future__ import annotations

import importlib.resources
import logging
from types import ModuleType

logger = logging.getLogger("sekv_vllm")


class KernelBuildError(RuntimeError):
    """A C++ kernel could not be compiled or loaded here."""


def build_cpu_extension(name: str, source: str, what: str) -> ModuleType:
    """The extension `name` compiled from csrc/cpu/`source`; KernelBuildError says why it is unavailable.
    what: the kernel, for the log ("the C++ decode kernel")."""
    try:
        from torch.utils.cpp_extension import load

        path = importlib.resources.files("sekv_vllm.csrc") / "cpu" / source
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from this installation")
        logger.info("sekv: loading %s (compiled on first use)", what)
        # -fno-trapping-math lets the branch-free exp/log loops vectorise (nothing reads FP exceptions), and
        # -fno-math-errno the square roots (nothing reads errno); no -ffast-math: results stay those of the
        # written operation order.
        return load(name=name, sources=[str(path)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # a compiler, header or linker failure: all mean "not here"
        raise KernelBuildError(f"{type(err).__name__}: {err}") from err
