"""graphcap: static, in-place sliding-window state and whole-loop CUDA-graph capture for MTP draft phases."""
from graphcap.spec import CaptureSpec, SpecError, load_spec
from graphcap.window import WindowBuffers, WindowError

__all__ = ["CaptureSpec", "SpecError", "load_spec", "WindowBuffers", "WindowError"]
__version__ = "0.1.0"
