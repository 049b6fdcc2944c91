"""numguard's command line.

    python -m numguard report FILE [--plot OUT.png]   render a dump (on_trip="dump") as text,
                                                      and optionally plot it
    python -m numguard advise FILE [--plot OUT.png] [--quant-plot OUT.png] [--all]
                                                      precision advice from a dump's module history
    python -m numguard install-hook [--target DIR]    install the NUMGUARD=1 start-up hook into
                                                      site-packages (pip install does this already)
    python -m numguard install-hook --remove          remove it again
    python -m numguard doctor [--json FILE] [--timeout S] [--sizes ...] [--pairs] [--plot PNG]
                              [--nccl-debug] [--iters N]
                                                      check a multi-rank job's machines and
                                                      collectives (run under torchrun, or alone)

Exit status: 0 on success, 2 on a usage error or a file that cannot be read (a dump that fails
its schema checks says what is wrong where, e.g. ``frames[3].records[2]: expected 8 numbers or
null, got 'abc'``), 1 when numguard itself fails. ``doctor``: 0 healthy, 1 when a check gave a
wrong result, a rank never joined or a step timed out, 2 on a bad option.
"""
import argparse
import os
import sys

__all__ = ["main"]


class _Failed(Exception):
    """A command's error message, already written; carries the exit status."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


def _load_dump(command, path):
    """A dump file, loaded and checked; a problem is written to stderr and raises _Failed."""
    from . import dump

    if not os.path.isfile(path):
        raise _Failed(_fail(f"{command}: {path!r} is not a file; give the path of a numguard dump "
                            "(a JSON file written by on_trip=\"dump\" / NUMGUARD_ON_TRIP=dump)"))
    try:
        return dump.load(path)
    except dump.DumpError as exc:
        raise _Failed(_fail(f"{command}: cannot read {exc}")) from None
    except OSError as exc:
        raise _Failed(_fail(f"{command}: cannot read {path!r} ({exc.strerror or exc})")) from None


def _plot(command, draw, what, out, flag="--plot"):
    """Draw `what` to `out` with `draw`; 0, or the exit status of a failure written to stderr."""
    from .plot import PlotUnavailableError

    try:
        draw(what, out)
    except PlotUnavailableError as exc:
        return _fail(f"{command} {flag}: {exc}")
    except (OSError, ValueError) as exc:
        return _fail(f"{command} {flag}: cannot draw {out!r} ({type(exc).__name__}: {exc})")
    sys.stdout.write(f"numguard: plot written to {out}\n")
    return 0


def _report(args):
    from . import report as _render

    path = args.file
    try:
        data = _load_dump("report", path)
    except _Failed as failed:
        return failed.status
    try:
        text = _render.render(data)
    except Exception as exc:  # noqa: BLE001 - a valid dump that does not render is numguard's bug
        return _fail(f"report: {path!r} passed the dump checks but could not be rendered "
                     f"({type(exc).__name__}: {exc}); please report this as a numguard bug", status=1)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if args.plot:
        from .plot import plot_dump

        return _plot("report", plot_dump, data, args.plot)
    return 0


def _advise(args):
    from . import advice as _advice

    try:
        data = _load_dump("advise", args.file)
    except _Failed as failed:
        return failed.status
    try:
        result = _advice.advise(data.get("history"))
    except _advice.AdviceError as exc:
        return _fail(f"advise: {args.file!r}: {exc}")
    sys.stdout.write(_advice.render(result, limit=len(result.modules) if args.all else 20) + "\n")
    status = 0
    if args.plot:
        from .plot import plot_advice

        status = _plot("advise", plot_advice, result, args.plot)
    if args.quant_plot and status == 0:
        from .plot import plot_quant

        status = _plot("advise", plot_quant, result, args.quant_plot, "--quant-plot")
    return status


def _default_site_packages():
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def _install_hook(args):
    from . import _startup

    target = args.target or _default_site_packages()
    path = os.path.join(target, _startup.PTH_NAME)
    if args.remove:
        if os.path.exists(path):
            os.remove(path)
            sys.stdout.write(f"numguard: removed {path}\n")
        else:
            sys.stdout.write(f"numguard: no start-up hook at {path}\n")
        return 0
    if not os.path.isdir(target):
        return _fail(f"install-hook: {target!r} is not a folder")
    with open(_startup.pth_path(), encoding="utf-8") as source:
        line = source.read()
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(line)
    except OSError as exc:
        return _fail(f"install-hook: cannot write {path!r} ({exc}); pass --target with a "
                     "site-packages folder you can write to")
    sys.stdout.write(f"numguard: start-up hook installed at {path} (active only with NUMGUARD=1)\n")
    return 0


def _doctor(args):
    from . import doctor
    from .env import MAX_DIST_TIMEOUT_S

    if not 0 < args.timeout <= MAX_DIST_TIMEOUT_S:  # also refuses nan
        return _fail(f"doctor: --timeout {args.timeout!r} is out of range; give seconds from "
                     f"more than 0 to {MAX_DIST_TIMEOUT_S:g}")
    if args.iters is not None and args.iters < 1:
        return _fail(f"doctor: --iters {args.iters} must be at least 1")
    try:
        sizes = doctor.parse_sizes(args.sizes) if args.sizes else None
    except doctor.DoctorError as exc:
        return _fail(f"doctor {exc}")
    options = doctor.Options(json=args.json, timeout=args.timeout, sizes=sizes, iters=args.iters,
                             pairs=args.pairs, plot=args.plot, nccl_debug=args.nccl_debug)
    try:
        status = doctor.run(options)
    except doctor.DoctorError as exc:
        # A usage error (2) is the user's to fix; anything else is the job failing its check.
        verdict = "" if exc.status == 2 else "FAILED: "
        status = _fail(f"doctor: {verdict}{exc}", status=exc.status)
    doctor.end_if_threads_abandoned(status)
    return status


def _fail(message, status=2):
    sys.stderr.write(f"numguard {message}\n")
    return status


def _parser():
    parser = argparse.ArgumentParser(prog="python -m numguard",
                                     description="numguard: find where a training job's numbers "
                                                 "go wrong.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser("report", help="render a dump written by on_trip=\"dump\"")
    report.add_argument("file", metavar="FILE", help="the JSON dump file")
    report.add_argument("--plot", metavar="OUT.png",
                        help="also draw abs max and min-nonzero per frame to this PNG "
                             "(needs matplotlib)")
    report.set_defaults(run=_report)
    advise = commands.add_parser("advise", help="precision advice (fp16 overflow, gradient underflow, "
                                                "loss scale) from a dump's module history")
    advise.add_argument("file", metavar="FILE", help="the JSON dump file")
    advise.add_argument("--plot", metavar="OUT.png",
                        help="also draw each module's dynamic range against float16's (needs matplotlib)")
    advise.add_argument("--quant-plot", metavar="OUT.png",
                        help="also draw watch(quant=...)'s underflow %% per module over batches as a heatmap "
                             "(needs matplotlib)")
    advise.add_argument("--all", action="store_true", help="list every module (default: the worst 20)")
    advise.set_defaults(run=_advise)
    hook = commands.add_parser("install-hook",
                               help="install the NUMGUARD=1 start-up hook into site-packages")
    hook.add_argument("--target", metavar="DIR",
                      help="the site-packages folder (default: this interpreter's)")
    hook.add_argument("--remove", action="store_true", help="remove the hook instead")
    hook.set_defaults(run=_install_hook)
    doc = commands.add_parser("doctor", help="check a multi-rank job's machines and collectives "
                                             "(torchrun --nproc_per_node N -m numguard doctor)")
    doc.add_argument("--json", metavar="FILE", help="write every fact, finding and figure here")
    doc.add_argument("--timeout", type=float, default=30.0, metavar="S",
                     help="seconds to wait for every rank at start-up, and for each step "
                          "(default 30)")
    doc.add_argument("--sizes", nargs="+", metavar="SIZE",
                     help="bandwidth sweep sizes, e.g. 1K 1M 64M (default 1K..256M on CUDA, "
                          "1K..4M on CPU)")
    doc.add_argument("--iters", type=int, metavar="N",
                     help="timed iterations per size (default 20 on CUDA, 5 on CPU)")
    doc.add_argument("--pairs", action="store_true",
                     help="also measure send/recv bandwidth between every pair of ranks")
    doc.add_argument("--plot", metavar="PNG", help="draw bandwidth against size (and the pair "
                                                   "matrix) to this PNG (needs matplotlib)")
    doc.add_argument("--nccl-debug", action="store_true",
                     help="NCCL_DEBUG=INFO with a log per rank, bundled next to the JSON")
    doc.set_defaults(run=_doctor)
    return parser


def main(argv=None):
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)
