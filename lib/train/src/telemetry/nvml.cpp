// NVML through dlopen: the few functions and types telemetry needs, declared here with NVML's
// stable C ABI (nvml.h of CUDA 11-13: these entry points and structs have not changed), so a
// build needs neither the header nor the library, and a host without the driver loses only the
// GPU figures.
#include <dlfcn.h>
#include <fmt/format.h>

#include "locus/train/telemetry/telemetry.hpp"

namespace locus::train::telemetry {

namespace {

using Return = int;  // nvmlReturn_t; NVML_SUCCESS = 0
constexpr Return kSuccess = 0;
using Device = void*;  // nvmlDevice_t (an opaque pointer)
struct Utilization {   // nvmlUtilization_t
  unsigned int gpu, memory;
};
struct Memory {  // nvmlMemory_t (v1)
  unsigned long long total, free, used;
};
constexpr int kTemperatureGpu = 0;              // NVML_TEMPERATURE_GPU
constexpr int kClockSm = 1, kClockMem = 2;      // NVML_CLOCK_SM, NVML_CLOCK_MEM
constexpr unsigned kNameLength = 96;            // NVML_DEVICE_NAME_V2_BUFFER_SIZE

}  // namespace

struct Nvml::Api {
  Return (*init)() = nullptr;
  Return (*shutdown)() = nullptr;
  const char* (*error_string)(Return) = nullptr;
  Return (*by_index)(unsigned, Device*) = nullptr;
  Return (*by_pci)(const char*, Device*) = nullptr;
  Return (*name)(Device, char*, unsigned) = nullptr;
  Return (*utilization)(Device, Utilization*) = nullptr;
  Return (*memory)(Device, Memory*) = nullptr;
  Return (*power)(Device, unsigned*) = nullptr;  // milliwatts
  Return (*temperature)(Device, int, unsigned*) = nullptr;
  Return (*clock)(Device, int, unsigned*) = nullptr;  // MHz

  std::string error(Return r) const {
    const char* s = error_string != nullptr ? error_string(r) : nullptr;
    return s != nullptr ? fmt::format("{} (NVML error {})", s, r) : fmt::format("NVML error {}", r);
  }
};

std::unique_ptr<Nvml> Nvml::load(std::string* why, const std::string& library) {
  void* lib = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    if (why != nullptr) {
      *why = fmt::format("NVML ({}) cannot be loaded: {}; GPU telemetry is off (it needs the "
                         "NVIDIA driver's libnvidia-ml.so.1)", library, e != nullptr ? e : "?");
    }
    return nullptr;
  }
  std::unique_ptr<Nvml> n(new Nvml);
  n->lib_ = lib;
  n->api_ = std::make_unique<Api>();
  Api& a = *n->api_;
  std::string missing;
  auto get = [&](auto& fn, const char* name) {
    void* p = ::dlsym(lib, name);
    if (p == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(name);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  get(a.init, "nvmlInit_v2");
  get(a.shutdown, "nvmlShutdown");
  get(a.error_string, "nvmlErrorString");
  get(a.by_index, "nvmlDeviceGetHandleByIndex_v2");
  get(a.by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
  get(a.name, "nvmlDeviceGetName");
  get(a.utilization, "nvmlDeviceGetUtilizationRates");
  get(a.memory, "nvmlDeviceGetMemoryInfo");
  get(a.power, "nvmlDeviceGetPowerUsage");
  get(a.temperature, "nvmlDeviceGetTemperature");
  get(a.clock, "nvmlDeviceGetClockInfo");
  if (!missing.empty()) {
    if (why != nullptr) {
      *why = fmt::format("NVML ({}) lacks {}: too old a driver; GPU telemetry is off", library,
                         missing);
    }
    n->api_->shutdown = nullptr;  // never initialised: nothing to shut down
    return nullptr;
  }
  if (const Return r = a.init(); r != kSuccess) {
    if (why != nullptr) {
      *why = fmt::format("nvmlInit failed: {}; GPU telemetry is off", a.error(r));
    }
    n->api_->shutdown = nullptr;
    return nullptr;
  }
  return n;
}

Nvml::~Nvml() {
  if (api_ && api_->shutdown != nullptr) api_->shutdown();
  if (lib_ != nullptr) ::dlclose(lib_);
}

bool Nvml::select(const std::string& pci_bus_id, unsigned index, std::string* why) {
  Device d = nullptr;
  const Return r = pci_bus_id.empty() ? api_->by_index(index, &d)
                                      : api_->by_pci(pci_bus_id.c_str(), &d);
  if (r != kSuccess || d == nullptr) {
    if (why != nullptr) {
      *why = fmt::format("NVML has no device {}: {}; GPU telemetry is off",
                         pci_bus_id.empty() ? fmt::format("{}", index) : pci_bus_id,
                         api_->error(r));
    }
    return false;
  }
  device_ = d;
  char name[kNameLength] = {};
  name_ = api_->name(d, name, kNameLength) == kSuccess ? std::string(name) : "?";
  return true;
}

GpuSample Nvml::sample() const {
  GpuSample s;
  if (device_ == nullptr) return s;
  const Api& a = *api_;
  if (Utilization u{}; a.utilization(device_, &u) == kSuccess) s.util_pct = u.gpu;
  if (Memory m{}; a.memory(device_, &m) == kSuccess) {
    s.mem_used_mib = static_cast<double>(m.used) / 1048576.0;
    s.mem_total_mib = static_cast<double>(m.total) / 1048576.0;
  }
  if (unsigned mw = 0; a.power(device_, &mw) == kSuccess) s.power_w = mw / 1000.0;
  if (unsigned c = 0; a.temperature(device_, kTemperatureGpu, &c) == kSuccess) s.temp_c = c;
  if (unsigned mhz = 0; a.clock(device_, kClockSm, &mhz) == kSuccess) s.sm_clock_mhz = mhz;
  if (unsigned mhz = 0; a.clock(device_, kClockMem, &mhz) == kSuccess) s.mem_clock_mhz = mhz;
  return s;
}

}  // namespace locus::train::telemetry
