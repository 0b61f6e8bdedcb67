// A stand-in for libnvidia-ml.so.1 with NVML's C ABI, for test_telemetry: one device (PCI bus
// id 0000:3B:00.0) with fixed figures, so the dlopen/dlsym path, the struct layouts and the
// unit conversions of lib/train/src/telemetry/nvml.cpp are checked on hosts without a GPU.
// FAKE_NVML_INIT_FAIL=1 makes nvmlInit_v2 fail (NVML_ERROR_DRIVER_NOT_LOADED = 9).
#include <cstdlib>
#include <cstring>
#include <strings.h>

extern "C" {

struct FakeUtilization { unsigned int gpu, memory; };
struct FakeMemory { unsigned long long total, free, used; };
static int device_tag = 42;
static int initialised = 0;

int nvmlInit_v2() {
  const char* fail = std::getenv("FAKE_NVML_INIT_FAIL");
  if (fail != nullptr && std::strcmp(fail, "1") == 0) return 9;
  ++initialised;
  return 0;
}
int nvmlShutdown() { return initialised-- > 0 ? 0 : 1; }
const char* nvmlErrorString(int r) {
  return r == 9 ? "Driver Not Loaded" : r == 6 ? "Not Found" : "Unknown Error";
}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void** d) {
  if (index != 0) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  *d = &device_tag;
  return 0;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* id, void** d) {
  if (strcasecmp(id, "0000:3b:00.0") != 0) return 6;  // NVML_ERROR_NOT_FOUND
  *d = &device_tag;
  return 0;
}
int nvmlDeviceGetName(void* d, char* name, unsigned length) {
  if (d != &device_tag) return 2;
  std::strncpy(name, "Fake H100", length);
  return 0;
}
int nvmlDeviceGetUtilizationRates(void* d, FakeUtilization* u) {
  if (d != &device_tag) return 2;
  *u = {87, 40};
  return 0;
}
int nvmlDeviceGetMemoryInfo(void* d, FakeMemory* m) {
  if (d != &device_tag) return 2;
  *m = {80ull << 30, 60ull << 30, 20ull << 30};
  return 0;
}
int nvmlDeviceGetPowerUsage(void* d, unsigned* mw) {
  if (d != &device_tag) return 2;
  *mw = 512250;
  return 0;
}
int nvmlDeviceGetTemperature(void* d, int sensor, unsigned* c) {
  if (d != &device_tag || sensor != 0) return 2;
  *c = 61;
  return 0;
}
int nvmlDeviceGetClockInfo(void* d, int clock, unsigned* mhz) {
  if (d != &device_tag) return 2;
  if (clock == 1) *mhz = 1980;       // NVML_CLOCK_SM
  else if (clock == 2) *mhz = 2619;  // NVML_CLOCK_MEM
  else return 3;                     // NVML_ERROR_NOT_SUPPORTED
  return 0;
}

}  // extern "C"
