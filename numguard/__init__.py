"""numguard: find where a PyTorch training job's numbers go wrong, fast enough to leave on.

    import numguard
    numguard.tensor_stats(x)            # float64[8] record: see numguard.STAT_FIELDS
    insp = numguard.watch(model)        # module hooks, device-side ring, report on NaN/Inf
"""
from .ops import STAT_FIELDS, backend, multi_tensor_stats, record_, tensor_stats
from .errors import Attribution, NonFiniteError, SpikeError, SpikeWarning
from .inspector import DebugUnderflowOverflow, Inspector, detect_overflow, watch
from .inspector.step_rerun import rerun_step  # noqa: E402
from . import dump  # noqa: E402  (numguard.dump.load / render_file for dump files)
from .memory import find_executable_batch_size, is_out_of_memory  # noqa: E402
from .patches import patched  # noqa: E402  (what numguard has changed in this process now)
from .quant import QUANT_FIELDS, multi_tensor_quant_stats, quant_stats  # noqa: E402

__all__ = ["STAT_FIELDS", "backend", "multi_tensor_stats", "record_", "tensor_stats",
           "watch", "Inspector", "DebugUnderflowOverflow", "detect_overflow", "NonFiniteError",
           "SpikeWarning", "SpikeError", "Attribution", "rerun_step",
           "find_executable_batch_size", "is_out_of_memory", "patched",
           "QUANT_FIELDS", "quant_stats", "multi_tensor_quant_stats"]
__version__ = "0.1.0"

# NOTE: [collective check at import] NUMGUARD_DIST_CHECK=1 in a script that imports numguard (not
# a NUMGUARD=1 job, whose start-up hook installs it) left the collectives unchecked until
# something happened to import numguard.distributed (a watched batch's cross-rank exchange,
# watch(accelerator, ...)): Accelerate's gathers of mismatched dicts before that returned values
# under the wrong keys. Importing numguard.distributed installs the guard. An invalid value fails
# here, naming the variable, as it does at start-up; so does an invalid NUMGUARD_DIST_TIMEOUT, but
# only when the check is on (a plain import validates no other variable).
from . import env as _env  # noqa: E402

if _env.read("NUMGUARD_DIST_CHECK") and _env.dist_settings_from_env()["dist_check"]:
    try:
        from . import distributed  # noqa: F401  (installs guard_collectives())
    except Exception as _exc:  # numguard's failure must not stop the job
        import warnings as _warnings

        _warnings.warn(f"numguard: NUMGUARD_DIST_CHECK=1 but the collective checks could not be installed "
                       f"({type(_exc).__name__}: {_exc}); collectives are not checked", RuntimeWarning,
                       stacklevel=2)


def __getattr__(name):
    # numguard.distributed imports torch.distributed machinery: load it on first use only.
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
