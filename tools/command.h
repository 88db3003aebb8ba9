// Subcommands of the `moekit` program register themselves here; one subcommand per file
// (tools/cmd_<name>.cpp). main.cpp dispatches and turns exceptions into exit codes.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace moekit::tools {

using CommandFn = std::function<int(const std::vector<std::string>& args)>;

struct Command {
    std::string name;
    std::string summary;
    CommandFn run;
};

std::vector<Command>& command_registry();

struct RegisterCommand {
    RegisterCommand(std::string name, std::string summary, CommandFn run) {
        command_registry().push_back({std::move(name), std::move(summary), std::move(run)});
    }
};

}  // namespace moekit::tools
