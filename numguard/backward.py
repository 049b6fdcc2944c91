"""``numguard.backward``: gradient watching, which lives in numguard.inspector.gradients (a part
of the Inspector). This name is the same module object, kept for the scripts that import it."""
import sys

from .inspector import gradients as _gradients

sys.modules[__name__] = _gradients
