#include <stdexcept>

#include "cpu_matmul.h"

#ifdef ZEROLITE_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace zerolite {

#ifdef ZEROLITE_X86
namespace {

// AMX's tiles are state Linux (5.16 on) hands a process only on request, once, for all its
// threads: a tile instruction without it is a SIGILL. Asked once, the first time the paths are listed.
bool amx_granted() {
  static const bool granted = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned AMX_BF16 = 1u << 22, AMX_TILE = 1u << 24, AMX_INT8 = 1u << 25;  // CPUID.(7, 0):EDX
    constexpr unsigned AMX = AMX_BF16 | AMX_TILE | AMX_INT8;
    if ((edx & AMX) != AMX) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

}  // namespace
#endif

std::vector<std::string> supported_cpu_paths() {
  std::vector<std::string> paths{"scalar"};
#ifdef ZEROLITE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    paths.push_back("avx2");
    paths.push_back("avx2int8");
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    paths.push_back("avx512");
  if (paths.back() == "avx512" && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi"))
    paths.push_back("avx512vnni");
  if (paths.back() == "avx512vnni" && __builtin_cpu_supports("avx512bf16")) paths.push_back("avx512bf16");
  if (paths.back() == "avx512bf16" && amx_granted()) paths.push_back("amx");
#endif
  return paths;
}

CpuPath cpu_path_named(const std::string& name) {
  for (const auto& path : supported_cpu_paths()) {
    if (path != name) continue;
    if (name == "amx") return CpuPath::amx;
    if (name == "avx512bf16") return CpuPath::avx512bf16;
    if (name == "avx512vnni") return CpuPath::avx512vnni;
    if (name == "avx512") return CpuPath::avx512;
    if (name == "avx2int8") return CpuPath::avx2int8;
    if (name == "avx2") return CpuPath::avx2;
    return CpuPath::scalar;
  }
  throw std::invalid_argument("this CPU has no '" + name + "' kernel path");
}

}  // namespace zerolite
