// The SM clock a benchmark's measurements ran at, read from NVML on a thread of its own while each one runs. An
// H100 / H200 under its 700 W cap lowers the SM clock as a kernel's power rises (nvidia-smi clocks_event_reasons
// 0x4, "SW power cap"), so two measurements of one round can run at different clocks: this says how much of a
// time ratio is clocks. NVML is the driver's (libnvidia-ml.so.1, opened at run time: no link-time dependency, and a
// machine without it samples nothing). Host-only header.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moekit::bench {

struct ClockStats {
    int samples = 0;
    double sm_mhz = 0;        // mean SM clock over the samples
    double power_capped = 0;  // fraction of the samples with the power-cap reason active (SW power cap or HW brake)
    double power_w = 0;       // mean board power NVML reported (its own averaging window: seconds, not this span)
    int failed_queries = 0;   // clock queries NVML refused while the measurement was open (not in `samples`)
};

class ClockSampler {
public:
    // Samples the GPU that CUDA calls `cuda_device` (found by its PCI bus id) every `period_us` while a
    // measurement is open; `max_measurements` measurements, numbered from 0.
    ClockSampler(int cuda_device, int max_measurements, int period_us = 500);
    ~ClockSampler();
    ClockSampler(const ClockSampler&) = delete;
    ClockSampler& operator=(const ClockSampler&) = delete;

    bool available() const;  // NVML found and the device opened
    std::string why_unavailable() const;
    // Samples taken between begin(m) and end() count for measurement m; the caller opens one at a time, around work
    // it then waits for (a timed run ends with an event synchronize), so the samples fall inside that work.
    void begin(int measurement);
    void end();
    ClockStats stats(int measurement) const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// {name: {"sm_mhz", "power_capped", "power_w", "samples"}} for each of the first n measurements with samples
// (names[m] names measurement m); an empty object where nothing was sampled (no NVML).
nlohmann::json clock_json(const ClockSampler& sampler, const std::vector<std::string>& names, int n);
// One table line, "  SM clock while timed (NVML): name 1520 MHz (power cap 96 %), ...", or "" for an empty object.
std::string format_clocks(const nlohmann::json& clocks);

}  // namespace moekit::bench
