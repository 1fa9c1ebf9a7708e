#include <stdexcept>

#include "cpu_matmul.h"

namespace zerolite {

std::vector<std::string> supported_cpu_paths() {
  std::vector<std::string> paths{"scalar"};
#ifdef ZEROLITE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths.push_back("avx2");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    paths.push_back("avx512");
  if (paths.back() == "avx512" && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi"))
    paths.push_back("avx512vnni");
  if (paths.back() == "avx512vnni" && __builtin_cpu_supports("avx512bf16")) paths.push_back("avx512bf16");
#endif
  return paths;
}

CpuPath cpu_path_named(const std::string& name) {
  for (const auto& path : supported_cpu_paths()) {
    if (path != name) continue;
    if (name == "avx512bf16") return CpuPath::avx512bf16;
    if (name == "avx512vnni") return CpuPath::avx512vnni;
    if (name == "avx512") return CpuPath::avx512;
    if (name == "avx2") return CpuPath::avx2;
    return CpuPath::scalar;
  }
  throw std::invalid_argument("this CPU has no '" + name + "' kernel path");
}

}  // namespace zerolite
