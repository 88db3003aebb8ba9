// Runs the built `moekit` binary (MOEKIT_BINARY, set by CMake for every test; the environment variable of that
// name overrides it, for test binaries carried to another machine) and captures its exit status and combined
// output, for end-to-end tests of the subcommands.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace moekit::testing_util {

struct ToolResult {
    int status = -1;
    std::string output;  // stdout + stderr
};

// Runs a shell command line (e.g. mpirun ...), capturing its status and combined output.
inline ToolResult run_shell(const std::string& command) {
    ToolResult r;
    const std::string cmd = command + " 2>&1";
    FILE* pipe = popen(cmd.c_str(), "r");
    if (!pipe) return r;
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
    const int raw = pclose(pipe);
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    return r;
}

// The moekit binary the tests run: $MOEKIT_BINARY where set, else the one this build made.
inline std::string moekit_binary() {
    const char* env = std::getenv("MOEKIT_BINARY");
    return env && *env ? env : MOEKIT_BINARY;
}

// args: everything after "moekit", e.g. "layer --init random --out R.safetensors".
inline ToolResult run_tool(const std::string& args) { return run_shell(moekit_binary() + " " + args); }

#ifdef MOEKIT_MPIEXEC
// The start of an mpirun command line for tool tests: as root, oversubscribed (CI has 2 cores). The ranks' leak
// check is off (make test-asan): OpenMPI's own allocations, partly in plugins it has unloaded at exit, are
// reported and no suppression can name them; the same code is leak-checked on virtual ranks.
inline std::string mpirun_prefix(int np) {
    return std::string(MOEKIT_MPIEXEC) + " --allow-run-as-root --oversubscribe -x ASAN_OPTIONS=detect_leaks=0 -np " +
           std::to_string(np) + " ";
}
#endif

}  // namespace moekit::testing_util
