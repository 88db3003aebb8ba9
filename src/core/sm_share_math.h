// How many SMs a persistent grouped GEMM's grid takes when part of the device is left to kernels running beside it
// (a wgrad on a stream of its own while the dgrad chain's memory passes run: src/cuda/moe_layer.cu). Plain C++
// (tests/cpu/test_sm_share.cpp).
#pragma once

namespace moekit {

// The SMs a persistent grid of `cluster`-CTA clusters takes on a device of `device_sms` when `left` SMs are to stay
// free for other kernels: device_sms - left rounded down to whole clusters, at least one cluster; all of them where
// nothing is left (left <= 0) or where leaving `left` would leave the grid less than half the device (the GEMM would
// then lose more than the kernels beside it could gain).
inline int grid_sms_leaving(int device_sms, int left, int cluster) {
    if (device_sms <= 0) return 0;
    if (cluster <= 0) cluster = 1;
    if (left <= 0 || 2 * left > device_sms) return device_sms;
    const int whole = (device_sms - left) / cluster * cluster;
    return whole >= cluster ? whole : device_sms;
}

}  // namespace moekit
