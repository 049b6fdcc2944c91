"""``numguard doctor``: check that a multi-rank job's machines, devices and collectives are sound.

Run it the way the job runs (``torchrun --nproc_per_node N -m numguard doctor``) or as one process.
It gathers facts from every rank, turns them into findings with advice, checks that collectives
return exact results, measures bus bandwidth, latency and stragglers, and never hangs: every wait
has a timeout that names the ranks that did not come. See :func:`numguard.doctor.runner.run`.

Modules: ``launcher`` (rendezvous, process group, timed steps), ``facts``, ``findings``,
``checks`` (correctness), ``performance``, ``report`` (text, JSON, plot), ``runner`` (the order).
"""
from .launcher import DoctorError, SettingError, end_if_threads_abandoned, parse_sizes
from .runner import Options, run

__all__ = ["DoctorError", "Options", "SettingError", "end_if_threads_abandoned", "parse_sizes", "run"]
