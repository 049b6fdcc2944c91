"""numguard inside training frameworks. Each module imports its framework only when it is used;
numguard itself depends on none of them.

    from numguard.integrations.transformers import NumguardCallback    # Trainer(callbacks=[...])
    from numguard.integrations.lightning import NumguardCallback       # pl.Trainer(callbacks=[...])
    from numguard.integrations.accelerate import watch                 # watch(accelerator, model)

Every integration watches with ``backward=True`` unless told otherwise (``NUMGUARD_BACKWARD`` or a
``backward=`` argument), so parameter gradients are checked before each optimizer step.
"""
__all__ = ["transformers", "lightning", "accelerate"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
