// Runs the built `moekit` binary (MOEKIT_BINARY, set by CMake for every test) and captures its exit
// status and combined output, for end-to-end tests of the subcommands.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace moekit::testing_util {

struct ToolResult {
    int status = -1;
    std::string output;  // stdout + stderr
};

// args: everything after "moekit", e.g. "layer --init random --out R.safetensors".
inline ToolResult run_tool(const std::string& args) {
    ToolResult r;
    const std::string cmd = std::string(MOEKIT_BINARY) + " " + args + " 2>&1";
    FILE* pipe = popen(cmd.c_str(), "r");
    if (!pipe) return r;
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
    const int raw = pclose(pipe);
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    return r;
}

}  // namespace moekit::testing_util
