// moekit: one executable, subcommands registered by tools/cmd_*.cpp.
// Exit status: 0 success, 1 engine failure, 2 bad usage (flag, value, file).
#include <algorithm>
#include <cstdio>
#include <exception>

#include "command.h"
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
            std::fprintf(stderr, "moekit %s: error: %s\n", name.c_str(), e.what());
            return 2;
        } catch (const std::exception& e) {
            std::fprintf(stderr, "moekit %s: internal error: %s\n", name.c_str(), e.what());
            return 1;
        }
    }
    std::fprintf(stderr, "moekit: unknown command '%s'\n", name.c_str());
    print_usage();
    return 2;
}
