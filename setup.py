"""Build numguard's native kernels as a PyTorch extension.

The CPU kernels are always built. The CUDA kernels are built when the installed torch is a
CUDA build and a CUDA toolkit is found; a GPU is not needed to build or link them.

Switches (environment):
  NUMGUARD_BUILD_CUDA=auto|0|1   force the CUDA kernels off (0) or on (1; fails if impossible)
  TORCH_CUDA_ARCH_LIST           CUDA architectures (default "8.0;9.0" when no GPU is visible)
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _build_cuda_setting():
    value = os.environ.get("NUMGUARD_BUILD_CUDA", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        sys.exit(f"NUMGUARD_BUILD_CUDA={value!r} is not valid: use auto, 0 or 1")
    return value


def _find_cuda_home():
    """The real toolkit folder. `nvcc` on PATH may be a wrapper script whose parent folder holds
    no toolkit, so ask nvcc itself where its top is."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    return os.path.realpath(match.group(1)) if match else os.path.dirname(os.path.dirname(nvcc))


def _extensions():
    import torch
    from torch.utils import cpp_extension

    build_cuda = _build_cuda_setting()
    cuda_home = None
    if build_cuda != "0" and torch.version.cuda:
        cuda_home = _find_cuda_home()
    with_cuda = build_cuda != "0" and bool(torch.version.cuda) and cuda_home is not None
    if build_cuda == "1" and not with_cuda:
        sys.exit("NUMGUARD_BUILD_CUDA=1 but the CUDA kernels cannot be built: "
                 f"torch.version.cuda={torch.version.cuda!r}, CUDA toolkit found: {cuda_home!r}")

    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [os.path.join(HERE, "csrc", "include")]
    # -ffp-contract=off: quant_stats sums float64 squares in one order on every instruction-set
    # level (NOTE: [quant lanes]); a multiply-add fused on one level and not on another would not.
    cxx_flags = ["-O3", "-g0", "-fvisibility=hidden", "-ffp-contract=off"]
    define_macros = []
    if not with_cuda:
        print("numguard: building the CPU kernels only "
              f"(torch.version.cuda={torch.version.cuda!r}, CUDA toolkit: {cuda_home!r})")
        return [cpp_extension.CppExtension(
            "numguard._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags}, define_macros=define_macros)]

    # torch's helper reads these module-level values, which it computed at import time.
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    # A CUDA torch wheel ships some toolkit headers (cuBLAS, ...) that a bare toolkit may lack.
    for site in sys.path:
        nv_include = os.path.join(site, "nvidia", f"cu{torch.version.cuda.split('.')[0]}", "include")
        if os.path.isdir(nv_include):
            include_dirs.append(nv_include)
    print(f"numguard: building CPU and CUDA kernels (CUDA_HOME={cuda_home}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})")
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("NUMGUARD_WITH_CUDA", "1"))
    return [cpp_extension.CUDAExtension(
        "numguard._C", sources, include_dirs=include_dirs, define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags,
                            "nvcc": ["-O3"]})]


STARTUP_HOOK_SOURCE = os.path.join("numguard", "_startup.pth")
STARTUP_HOOK_NAME = "numguard-startup.pth"  # sorts after setuptools' __editable__ files


class BuildPyWithStartupHook(build_py):
    """Also install numguard's start-up hook at the top of site-packages, where Python's `site`
    runs it at every start-up (it does nothing unless NUMGUARD is set; see numguard/_startup.py).
    A regular build puts it at the top of the wheel; an editable install at the top of the
    editable wheel, which setuptools builds from its install folder."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, STARTUP_HOOK_SOURCE),
                       os.path.join(self._startup_hook_folder(), STARTUP_HOOK_NAME),
                       preserve_mode=False)

    def _startup_hook_folder(self):
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, STARTUP_HOOK_NAME))
        return outputs


BUILD_INFO_NAME = "_build_info.py"  # next to numguard/_C*.so; read by numguard.ops before importing _C


def _build_info_source():
    import torch
    return ('"""Written by numguard\'s setup.py when it built numguard._C: the torch it was built against.\n'
            'numguard.ops compares these with the running torch before importing _C."""\n'
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA_VERSION = {torch.version.cuda!r}\n")


def _cmdclass():
    from torch.utils import cpp_extension

    class BuildExtWithBuildInfo(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        """Also write numguard/_build_info.py beside the built extension (and beside its in-place
        copy for --inplace and editable installs), so that a torch upgrade without a rebuild is
        detected before the mismatched .so is loaded."""

        def run(self):
            super().run()
            folders = {os.path.dirname(self.get_ext_fullpath("numguard._C"))}
            if self.inplace:  # setuptools built into build_lib, then copied the .so into the source
                self.inplace = False
                folders.add(os.path.dirname(self.get_ext_fullpath("numguard._C")))
                self.inplace = True
            for folder in folders:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, BUILD_INFO_NAME), "w") as f:
                    f.write(_build_info_source())

    return {"build_ext": BuildExtWithBuildInfo, "build_py": BuildPyWithStartupHook}


setup(ext_modules=_extensions(), cmdclass=_cmdclass())
