// ClockSampler (gpu_clocks.h): NVML's C entry points, declared here as the driver exports them (nvml.h is not part
// of every CUDA install), looked up with dlsym.
#include "lib/gpu_clocks.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

namespace moekit::bench {

namespace {

using NvmlReturn = int;  // nvmlReturn_t: 0 = NVML_SUCCESS
using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr int kNvmlClockSm = 1;  // NVML_CLOCK_SM
// nvmlClocksEventReasons: SW power cap, HW power brake slowdown.
constexpr unsigned long long kPowerCapReasons = 0x4ull | 0x80ull;

struct Nvml {
    void* lib = nullptr;
    NvmlReturn (*init)() = nullptr;
    NvmlReturn (*shutdown)() = nullptr;
    NvmlReturn (*by_pci)(const char*, NvmlDevice*) = nullptr;
    NvmlReturn (*clock)(NvmlDevice, int, unsigned*) = nullptr;
    NvmlReturn (*reasons)(NvmlDevice, unsigned long long*) = nullptr;
    NvmlReturn (*power)(NvmlDevice, unsigned*) = nullptr;

    template <typename F>
    bool find(F& f, const char* name) {
        f = reinterpret_cast<F>(dlsym(lib, name));
        return f != nullptr;
    }
};

}  // namespace

struct ClockSampler::Impl {
    Nvml nvml;
    NvmlDevice dev = nullptr;
    std::string why;
    bool initialised = false;
    std::atomic<int> current{-1};
    std::atomic<bool> stop{false};
    mutable std::mutex mu;
    struct Sum {
        int n = 0, capped = 0, power_n = 0, failed = 0;
        double mhz = 0, power_w = 0;
    };
    std::vector<Sum> sums;
    std::thread thread;

    bool open(int cuda_device) {
        nvml.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!nvml.lib) return why = "libnvidia-ml.so.1 not found", false;
        // The *_v2 names are the ones current drivers export under the unversioned macros of nvml.h.
        if (!nvml.find(nvml.init, "nvmlInit_v2") || !nvml.find(nvml.shutdown, "nvmlShutdown") ||
            !nvml.find(nvml.by_pci, "nvmlDeviceGetHandleByPciBusId_v2") ||
            !nvml.find(nvml.clock, "nvmlDeviceGetClockInfo"))
            return why = "NVML lacks an entry point this sampler needs", false;
        if (!nvml.find(nvml.reasons, "nvmlDeviceGetCurrentClocksEventReasons"))
            nvml.find(nvml.reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");  // older drivers' name
        nvml.find(nvml.power, "nvmlDeviceGetPowerUsage");
        if (nvml.init() != 0) return why = "nvmlInit failed", false;
        initialised = true;
        char bus_id[32] = {};
        if (cudaDeviceGetPCIBusId(bus_id, int(sizeof bus_id), cuda_device) != cudaSuccess)
            return why = "cudaDeviceGetPCIBusId failed", false;
        if (nvml.by_pci(bus_id, &dev) != 0) return why = std::string("NVML has no device at ") + bus_id, false;
        // One query of each kind now: NVML's first answers for a device can take longer than a short measurement,
        // and a sample still in flight when its measurement closes is dropped (sample()).
        unsigned mhz = 0, mw = 0;
        unsigned long long r = 0;
        if (nvml.clock(dev, kNvmlClockSm, &mhz) != 0) return why = "nvmlDeviceGetClockInfo failed", false;
        if (nvml.reasons) nvml.reasons(dev, &r);
        if (nvml.power) nvml.power(dev, &mw);
        return true;
    }

    void sample(int m) {
        unsigned mhz = 0, mw = 0;
        unsigned long long r = 0;
        const bool have_clock = nvml.clock(dev, kNvmlClockSm, &mhz) == 0;
        const bool have_reasons = have_clock && nvml.reasons && nvml.reasons(dev, &r) == 0;
        const bool have_power = have_clock && nvml.power && nvml.power(dev, &mw) == 0;
        std::lock_guard<std::mutex> lock(mu);
        if (current.load() != m) return;  // the measurement closed while NVML answered
        Sum& s = sums[size_t(m)];
        if (!have_clock) return void(++s.failed);
        ++s.n, s.mhz += mhz;
        s.capped += have_reasons && (r & kPowerCapReasons) ? 1 : 0;
        if (have_power) ++s.power_n, s.power_w += mw / 1000.0;
    }
};

ClockSampler::ClockSampler(int cuda_device, int max_measurements, int period_us) : impl_(std::make_unique<Impl>()) {
    impl_->sums.resize(size_t(max_measurements > 0 ? max_measurements : 0));
    if (!impl_->open(cuda_device)) return;
    Impl* p = impl_.get();
    p->thread = std::thread([p, period_us] {
        while (!p->stop.load()) {
            const int m = p->current.load();
            if (m >= 0) p->sample(m);
            std::this_thread::sleep_for(std::chrono::microseconds(period_us));
        }
    });
}

ClockSampler::~ClockSampler() {
    impl_->stop = true;
    if (impl_->thread.joinable()) impl_->thread.join();
    if (impl_->initialised) impl_->nvml.shutdown();
    if (impl_->nvml.lib) dlclose(impl_->nvml.lib);
}

bool ClockSampler::available() const { return impl_->thread.joinable(); }
std::string ClockSampler::why_unavailable() const { return impl_->why; }

void ClockSampler::begin(int measurement) {
    if (measurement >= 0 && size_t(measurement) < impl_->sums.size()) impl_->current = measurement;
}

void ClockSampler::end() {
    std::lock_guard<std::mutex> lock(impl_->mu);  // a sample in flight lands before the next begin, or not at all
    impl_->current = -1;
}

ClockStats ClockSampler::stats(int measurement) const {
    ClockStats out;
    if (measurement < 0 || size_t(measurement) >= impl_->sums.size()) return out;
    std::lock_guard<std::mutex> lock(impl_->mu);
    const Impl::Sum& s = impl_->sums[size_t(measurement)];
    out.samples = s.n;
    out.failed_queries = s.failed;
    if (s.n > 0) out.sm_mhz = s.mhz / s.n, out.power_capped = double(s.capped) / s.n;
    if (s.power_n > 0) out.power_w = s.power_w / s.power_n;
    return out;
}

nlohmann::json clock_json(const ClockSampler& sampler, const std::vector<std::string>& names, int n) {
    nlohmann::json out = nlohmann::json::object();
    for (int m = 0; m < n && size_t(m) < names.size(); ++m) {
        const ClockStats c = sampler.stats(m);
        if (c.samples == 0) continue;
        out[names[size_t(m)]] = {
            {"sm_mhz", c.sm_mhz}, {"power_capped", c.power_capped}, {"power_w", c.power_w}, {"samples", c.samples}};
    }
    return out;
}

std::string format_clocks(const nlohmann::json& clocks) {
    if (clocks.empty()) return "";
    std::string out = "  SM clock while timed (NVML):";
    char cell[96];
    const char* sep = " ";
    for (auto& [name, c] : clocks.items()) {
        std::snprintf(cell, sizeof cell, "%s%s %.0f MHz (power cap %.0f %%)", sep, name.c_str(),
                      c["sm_mhz"].get<double>(), 100 * c["power_capped"].get<double>());
        out += cell;
        sep = ", ";
    }
    return out + "\n";
}

}  // namespace moekit::bench
