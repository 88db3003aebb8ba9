// moekit: one executable, subcommands registered by tools/cmd_*.cpp.
// Exit status: 0 success, 1 engine failure, 2 bad usage (flag, value, file); under mpirun the first
// failing rank's status ends the job.
#include <algorithm>
#include <cstdio>
#include <exception>

#include "command.h"
#include "moekit/comm.h"
#include "moekit/error.h"

namespace moekit::tools {
std::vector<Command>& command_registry() {
    static std::vector<Command> commands;
    return commands;
}
}  // namespace moekit::tools

static void print_usage() {
    auto commands = moekit::tools::command_registry();
    std::sort(commands.begin(), commands.end(), [](auto& a, auto& b) { return a.name < b.name; });
    std::fprintf(stderr, "usage: moekit <command> [flags]\n\ncommands:\n");
    for (auto& c : commands) std::fprintf(stderr, "  %-8s %s\n", c.name.c_str(), c.summary.c_str());
    std::fprintf(stderr, "\nRun `moekit <command> --help` for its flags.\n");
}

// Under mpirun with several ranks an error names its rank and ends the whole job (MPI_Abort), so a
// failing rank never leaves the others waiting in a collective.
static int fail(const std::string& command, const char* kind, const char* what, int code) {
    const std::string rank = moekit::comm::mpi_rank_label();
    std::fprintf(stderr, "moekit %s: %s%s%s: %s\n", command.c_str(), kind, rank.empty() ? "" : " on ", rank.c_str(),
                 what);
    if (moekit::comm::mpi_active()) moekit::comm::abort_job(code);
    return code;
}

int main(int argc, char** argv) {
    if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
        print_usage();
        return argc < 2 ? 2 : 0;
    }
    std::string name = argv[1];
    std::vector<std::string> args(argv + 2, argv + argc);
    for (auto& c : moekit::tools::command_registry()) {
        if (c.name != name) continue;
        try {
            return c.run(args);
        } catch (const moekit::UsageError& e) {
            return fail(name, "error", e.what(), 2);
        } catch (const std::exception& e) {
            return fail(name, "internal error", e.what(), 1);
        }
    }
    std::fprintf(stderr, "moekit: unknown command '%s'\n", name.c_str());
    print_usage();
    return 2;
}
