"""Test launcher for one rank of ``numguard doctor``: injects a fault into this rank, then runs it.

NUMGUARD_DOCTOR_TEST_FAULT is read here only (numguard itself never reads it):
  wrong_all_reduce     every all_reduce on this rank returns its result plus 1
  slow_all_reduce:S    every all_reduce on this rank sleeps S seconds before it starts
  exit_on_all_reduce:N   the N-th all_reduce on this rank calls os._exit(1) (a crash)
  kill_on_all_reduce:N   the N-th all_reduce on this rank sends itself SIGKILL (the OOM killer)
  json_write_fails     writing the --json file fails as on a full disk (ENOSPC)
  kernel:VERSION       platform.release() returns VERSION
  torch:VERSION        torch.__version__ reads VERSION
Arguments are passed to ``numguard doctor``.
"""
import os
import platform
import signal
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _inject(fault):
    kind, _, value = fault.partition(":")
    real = dist.all_reduce
    if kind == "wrong_all_reduce":
        def all_reduce(tensor, *args, **kwargs):
            work = real(tensor, *args, **kwargs)
            if work is not None:
                work.wait()
            tensor.add_(1)
            return work
        dist.all_reduce = all_reduce
    elif kind == "slow_all_reduce":
        def all_reduce(tensor, *args, **kwargs):
            time.sleep(float(value))
            return real(tensor, *args, **kwargs)
        dist.all_reduce = all_reduce
    elif kind in ("exit_on_all_reduce", "kill_on_all_reduce"):
        calls = []

        def all_reduce(tensor, *args, **kwargs):
            calls.append(1)
            if len(calls) == int(value):
                sys.stdout.flush()
                if kind == "exit_on_all_reduce":
                    os._exit(1)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(tensor, *args, **kwargs)
        dist.all_reduce = all_reduce
    elif kind == "json_write_fails":
        import errno

        from numguard.doctor import report

        def write_json(result, path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        report.write_json = write_json
    elif kind == "kernel":
        platform.release = lambda: value
    elif kind == "torch":
        torch.__version__ = value
    elif kind:
        raise SystemExit(f"doctor_rank.py: unknown NUMGUARD_DOCTOR_TEST_FAULT {fault!r}")


if __name__ == "__main__":
    _inject(os.environ.get("NUMGUARD_DOCTOR_TEST_FAULT", ""))
    from numguard.cli import main

    sys.exit(main(["doctor"] + sys.argv[1:]))
