"""The CUDA quant kernels (csrc/cuda/quant_kernels.cu). Their tiling and merging (quant_device.cuh:
NOTE: [quant tiles], [quant block merge]) differ from the CPU kernel's chunks and lanes, so a launch
is emulated on the host, lane by lane, with the same header functions, and its record compared with
the CPU kernel's (every field exact, sq_error to float64 rounding: another order). On a GPU the
kernels themselves are compared with the CPU kernel and counted for host syncs."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import numguard
from numguard import schema
from numguard.quant import FORMAT_CODES, quant_stats

from conftest import no_host_sync
from test_quant_kernels import vector_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = list(schema.QUANT_FORMATS)
native = pytest.mark.skipif(numguard.backend() != "native", reason="the native kernels are not loaded")

# One launch of quant_measure_kernel + quant_finish_kernel, run on the host: every CUDA block,
# warp and lane of the grid in turn; the warp shuffles and ballots replaced by loops over the
# 32 lanes, the merges done in the kernel's tree order.
LAUNCH_EMULATION = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant_device.cuh"

using namespace numguard;
using namespace numguard::cuda;

static uint32_t bits_of(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
static float float_of(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

int main(int argc, char** argv) {
  // args: input file (float32), format code, mode (0 quant_stats, 1 watch's current scaling),
  // scale source (0 host, 1 NVFP4's g from amax, 2 current scale), host scale
  FILE* in = std::fopen(argv[1], "rb");
  std::vector<float> data;
  float v;
  while (std::fread(&v, 4, 1, in) == 1) data.push_back(v);
  std::fclose(in);
  const int64_t format = std::atoll(argv[2]);
  const int mode = std::atoi(argv[3]);
  const int source = std::atoi(argv[4]);
  const float host_scale = static_cast<float>(std::atof(argv[5]));
  const int64_t n = static_cast<int64_t>(data.size());
  // the amax pass
  uint32_t amax_bits = 0;
  bool nonfinite = false;
  for (float x : data) {
    if (std::isfinite(x)) amax_bits = bits_of(std::fabs(x)) > amax_bits ? bits_of(std::fabs(x)) : amax_bits;
    else nonfinite = true;
  }
  const QuantElement f = quant_element(format);
  const float amax = float_of(amax_bits);
  const float scale = source == 0 ? host_scale
                    : source == 1 ? nvfp4_global_scale(amax) : quant_current_scale(amax, nonfinite, f.max_value);
  const int64_t grid = quant_grid_blocks(n);
  const int64_t tiles = (n + kQuantTile - 1) / kQuantTile;
  const QuantBlockScale tensor_scale = quant_block_scale(format, 0.0f, scale);
  std::vector<QuantAccum> partials(grid);
  for (int64_t blk = 0; blk < grid; ++blk) {
    std::vector<QuantAccum> acc(kQuantThreads);
    for (auto& a : acc) a.init();
    for (int warp = 0; warp < kQuantWarps; ++warp) {
      for (int64_t tile = quant_first_tile(blk, warp); tile < tiles; tile += quant_tile_step(grid)) {
        float x[32];
        bool valid[32], saturated[32];
        QuantBlockScale b[32];
        for (int lane = 0; lane < 32; ++lane) {
          const int64_t i = tile * kQuantTile + lane;
          valid[lane] = i < n;
          x[lane] = valid[lane] ? data[i] : 0.0f;
        }
        for (int lane = 0; lane < 32; ++lane) {
          b[lane] = tensor_scale;
          if (!quant_per_tensor(format)) {
            uint32_t top = 0;
            for (int other = 0; other < 32; ++other) {
              if ((quant_block_lane_mask(format, lane) >> other) & 1u) {
                const uint32_t o = bits_of(quant_finite_abs(x[other]));
                top = o > top ? o : top;
              }
            }
            b[lane] = quant_block_scale(format, float_of(top), scale);
          }
          saturated[lane] = quant_lane_element(acc[warp * 32 + lane], format, f, b[lane], mode, x[lane], valid[lane]);
        }
        uint32_t ballot = 0;
        for (int lane = 0; lane < 32; ++lane) ballot |= static_cast<uint32_t>(saturated[lane]) << lane;
        for (int lane = 0; lane < 32; ++lane) {
          quant_lane_block(acc[warp * 32 + lane], format, b[lane], valid[lane] && quant_block_leader(format, lane),
                           (ballot & quant_block_lane_mask(format, lane)) != 0);
        }
      }
      // the warp's shuffle tree: lane l takes lane l + offset (lanes past 31 keep their own: unused)
      for (int offset = 16; offset > 0; offset >>= 1) {
        std::vector<QuantAccum> before(acc.begin() + warp * 32, acc.begin() + warp * 32 + 32);
        for (int lane = 0; lane < 32; ++lane) {
          acc[warp * 32 + lane].merge(before[lane + offset < 32 ? lane + offset : lane]);
        }
      }
    }
    std::vector<QuantAccum> warps(kQuantWarps);
    for (int w = 0; w < kQuantWarps; ++w) warps[w] = acc[w * 32];
    for (int offset = kQuantWarps / 2; offset > 0; offset >>= 1) {
      for (int w = 0; w < offset; ++w) warps[w].merge(warps[w + offset]);
    }
    partials[blk] = warps[0];
  }
  QuantAccum total;
  total.init();
  for (int64_t blk = 0; blk < grid; ++blk) total.merge(partials[blk]);
  quant_finish_record(total, format, n, scale, mode);
  double record[kNumQuantFields];
  total.write(record);
  for (int j = 0; j < kNumQuantFields; ++j) std::printf("%a\n", record[j]);
  return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler (c++/g++, or CXX) to compile the CUDA launch for the host")
    folder = tmp_path_factory.mktemp("quant_emulation")
    source = folder / "quant_launch.cpp"
    source.write_text(LAUNCH_EMULATION)
    exe = folder / "quant_launch"
    build = subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", f"-I{os.path.join(ROOT, 'csrc', 'include')}",
                            f"-I{os.path.join(ROOT, 'csrc', 'cuda')}", str(source), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]

    def launch(x, fmt, mode=0, source=0, scale=1.0):
        path = folder / "input.bin"
        path.write_bytes(np.ascontiguousarray(x.float().numpy()).tobytes())
        run = subprocess.run([str(exe), str(path), str(FORMAT_CODES[fmt]), str(mode), str(source), repr(scale)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return torch.tensor([float.fromhex(v) for v in run.stdout.split()], dtype=torch.float64)
    return launch


def _same_record(got, want, where):
    keep = [i for i, name in enumerate(schema.QUANT_FIELDS) if name != "sq_error"]
    assert torch.equal(got[keep], want[keep]), (where, got, want)
    g, w = got[schema.Q_SQ_ERROR].item(), want[schema.Q_SQ_ERROR].item()
    assert g == pytest.approx(w, rel=1e-12) or g == w, (where, g, w)


def _inputs(fmt):
    gen = torch.Generator().manual_seed(2)
    n = 2 * 32 * 8 * 4 * 3 + 45  # several tiles per warp, a ragged last tile
    spread = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 12, (n,), generator=gen)).float()
    spread[::37] = 0.0
    spread[100] = float("nan")
    return {"grid": vector_input(fmt), "spread": spread, "short": spread[:21], "empty": spread[:0],
            "big": torch.randn(300_001, generator=gen)}


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_launch_emulated_on_the_host_matches_the_cpu_kernel(emulator, fmt):
    for name, x in _inputs(fmt).items():
        source = 1 if fmt == "nvfp4" else 0
        _same_record(emulator(x, fmt, source=source), quant_stats(x, fmt), (fmt, name))
    if fmt.startswith("float8") or fmt == "nvfp4":
        x = _inputs(fmt)["spread"]
        _same_record(emulator(x, fmt, scale=0.5), quant_stats(x, fmt, scale=0.5), (fmt, "scale 0.5"))


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_watch_measurement_emulated_matches_the_cpu_op(emulator, fmt):
    """quant_watch_'s per-tensor current scaling (mode 1, the scale from the amax pass) and block
    formats, against the CPU op."""
    per_tensor = fmt.startswith("float8")
    for name, x in _inputs(fmt).items():
        sums = torch.zeros((1, 6), dtype=torch.float64)
        want = torch.ops.numguard.quant_watch_(sums, 0, [x], FORMAT_CODES[fmt])[0]
        got = emulator(x, fmt, mode=1 if per_tensor else 0, source=2 if per_tensor else (1 if fmt == "nvfp4" else 0))
        _same_record(got, want, (fmt, name))


# ------------------------------------------------------------------------------------------------
# On a GPU.

def _require_gpu_kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("numguard::quant_stats", "CUDA"):
        pytest.skip("the extension was built without its CUDA kernels")


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_kernel_matches_the_cpu_kernel_without_host_sync(fmt):
    _require_gpu_kernels()
    for name, x in _inputs(fmt).items():
        xc = x.cuda()
        torch.cuda.synchronize()
        with no_host_sync(xc.device):
            got = quant_stats(xc, fmt)
            watch_sums = torch.zeros((1, 6), dtype=torch.float64, device="cuda")
            watched = torch.ops.numguard.quant_watch_(watch_sums, 0, [xc, xc.bfloat16()], FORMAT_CODES[fmt])
        _same_record(got.cpu(), quant_stats(x, fmt), (fmt, name))
        cpu_sums = torch.zeros((1, 6), dtype=torch.float64)
        want = torch.ops.numguard.quant_watch_(cpu_sums, 0, [x, x.bfloat16()], FORMAT_CODES[fmt])
        for i in range(2):
            _same_record(watched[i].cpu(), want[i], (fmt, name, "watch", i))
        assert torch.allclose(watch_sums.cpu(), cpu_sums, rtol=1e-12, atol=0), (fmt, name)
        again = quant_stats(xc, fmt)  # deterministic: the same grid gives the same bits
        assert torch.equal(again.cpu(), got.cpu())
