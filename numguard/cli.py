"""numguard's command line.

    python -m numguard report FILE [--plot OUT.png]   render a dump (on_trip="dump") as text,
                                                      and optionally plot it
    python -m numguard install-hook [--target DIR]    install the NUMGUARD=1 start-up hook into
                                                      site-packages (pip install does this already)
    python -m numguard install-hook --remove          remove it again

Exit status: 0 on success, 2 on a usage error or a file that cannot be read (a dump that fails
its schema checks says what is wrong where, e.g. ``frames[3].records[2]: expected 8 numbers or
null, got 'abc'``), 1 when numguard itself fails.
"""
import argparse
import os
import sys

__all__ = ["main"]


def _report(args):
    from . import dump
    from . import report as _render

    path = args.file
    if not os.path.isfile(path):
        return _fail(f"report: {path!r} is not a file; give the path of a numguard dump "
                     "(a JSON file written by on_trip=\"dump\" / NUMGUARD_ON_TRIP=dump)")
    try:
        data = dump.load(path)
    except dump.DumpError as exc:
        return _fail(f"report: cannot read {exc}")
    except OSError as exc:
        return _fail(f"report: cannot read {path!r} ({exc.strerror or exc})")
    try:
        text = _render.render(data)
    except Exception as exc:  # noqa: BLE001 - a valid dump that does not render is numguard's bug
        return _fail(f"report: {path!r} passed the dump checks but could not be rendered "
                     f"({type(exc).__name__}: {exc}); please report this as a numguard bug", status=1)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if args.plot:
        from .plot import PlotUnavailableError, plot_dump

        try:
            plot_dump(data, args.plot)
        except PlotUnavailableError as exc:
            return _fail(f"report --plot: {exc}")
        except (OSError, ValueError) as exc:
            return _fail(f"report --plot: cannot draw {args.plot!r} ({type(exc).__name__}: {exc})")
        sys.stdout.write(f"numguard: plot written to {args.plot}\n")
    return 0


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
    hook = commands.add_parser("install-hook",
                               help="install the NUMGUARD=1 start-up hook into site-packages")
    hook.add_argument("--target", metavar="DIR",
                      help="the site-packages folder (default: this interpreter's)")
    hook.add_argument("--remove", action="store_true", help="remove the hook instead")
    hook.set_defaults(run=_install_hook)
    return parser


def main(argv=None):
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)
