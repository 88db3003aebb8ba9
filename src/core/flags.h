// Command-line flags: one table per command, from which parsing, --help, --config FILE.json and the
// resolved-config JSON are all derived. add_moe_flags() is THE table of MoeConfig flags (Megatron
// spellings and defaults); each subcommand adds its own flags to the same parser:
//     FlagParser p("moekit layer [flags]"); add_moe_flags(p, cfg); p.add("--out", &out, "output file");
//     if (!p.parse(args)) return 0;  // --help was printed
// Implementation: src/core/flags.cpp (parser), src/core/moe_flags.cpp (table). Tests: tests/cpu/test_config.cpp.
#pragma once
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moekit/config.h"

namespace moekit {

class FlagParser {
   public:
    enum class Kind { boolean, integer, unsigned_integer, real, text, text_list, real_list, action, unsupported };

    struct Flag {
        std::string name;   // "--moe-router-topk"
        std::string field;  // "moe_router_topk": the JSON key (the flag without dashes is accepted too)
        Kind kind = Kind::text;
        bool optional = false;  // "none"/null resets it
        std::string type;       // "int", "float", "str", "bool", "int|None", "str...", for --help and errors
        std::string default_value;
        std::string help;
        std::string section;
        std::function<void(const std::vector<std::string>&)> set;  // parse + store (throws UsageError)
        std::function<nlohmann::json()> get;                       // current value (empty for actions)
        Flag& with_field(std::string f) {
            field = std::move(f);
            return *this;
        }
    };

    explicit FlagParser(std::string usage = "moekit [flags]");

    // Typed flags bound to a variable; --help shows the variable's value at this call as the default.
    Flag& add(const std::string& name, bool* target, const std::string& help);
    Flag& add(const std::string& name, int64_t* target, const std::string& help);
    Flag& add(const std::string& name, uint64_t* target, const std::string& help);
    Flag& add(const std::string& name, double* target, const std::string& help);
    Flag& add(const std::string& name, std::string* target, const std::string& help);
    Flag& add(const std::string& name, std::optional<int64_t>* target, const std::string& help);
    Flag& add(const std::string& name, std::optional<double>* target, const std::string& help);
    Flag& add(const std::string& name, std::optional<std::string>* target, const std::string& help);
    Flag& add(const std::string& name, std::vector<std::string>* target, const std::string& help);  // one or more
    Flag& add(const std::string& name, std::vector<double>* target, const std::string& help);       // one or more
    // A flag without a value that runs `action` (e.g. --swiglu sets two fields).
    Flag& add_action(const std::string& name, std::function<void()> action, const std::string& help);
    // A known (Megatron) flag that moekit refuses with "--name: not supported yet by moekit".
    void add_unsupported(const std::string& name, const std::string& why = "");
    // Later flags are listed under this heading in --help.
    void section(const std::string& title) { section_ = title; }

    // Parses flags: --name value, --name=value, --flag / --no-flag / --flag=true for booleans, one or more
    // values for lists (also comma-separated), --config FILE.json (applied first; explicit flags override it),
    // --help. A flag given twice on the command line (or twice in one --config file) is refused: the last one
    // silently winning hides a mistake. Runs the add_rule() rules last. Throws UsageError naming the flag on any
    // problem. Returns false when --help was printed.
    bool parse(const std::vector<std::string>& args);
    // Applies a JSON object {flag name without dashes | field name: value}; `source` names it in errors.
    void apply_json(const nlohmann::json& object, const std::string& source);
    void apply_json_file(const std::string& path);

    bool was_set(const std::string& name) const { return set_flags_.count(name) > 0; }
    // Where a flag was last set ("command line" or a --config file), "" when it was not.
    std::string where_set(const std::string& name) const;
    // The values a flag was last given, as written (e.g. {"relu"}); nullptr when it was not set.
    const std::vector<std::string>* given(const std::string& name) const;
    // A rule run after parse() over the flags given (e.g. two flags that contradict each other);
    // it throws UsageError naming both.
    void add_rule(std::function<void(const FlagParser&)> rule) { rules_.push_back(std::move(rule)); }
    std::string help() const;
    nlohmann::json values() const;  // field -> value, for every flag bound to a variable
    const std::deque<Flag>& flags() const { return flags_; }
    const Flag* find(const std::string& name) const;     // by "--name"
    std::string nearest(const std::string& name) const;  // closest known flag, "" if none is close

   private:
    Flag& insert(Flag flag);
    void apply(Flag& flag, const std::vector<std::string>& values, const std::string& where);
    Flag* lookup(const std::string& name);
    Flag* lookup_key(const std::string& key);  // JSON key: field name or flag without dashes

    std::string usage_;
    std::string section_ = "flags";
    std::deque<Flag> flags_;
    std::map<std::string, size_t> by_name_;
    std::map<std::string, std::string> set_flags_;  // name -> where it was set
    std::map<std::string, std::vector<std::string>> given_;  // name -> values as given
    std::vector<std::function<void(const FlagParser&)>> rules_;
};

// THE table of MoeConfig flags (Megatron spellings) and the Megatron MoE flags moekit refuses.
void add_moe_flags(FlagParser& parser, MoeConfig& config);

// Every MoeConfig field by name (the keys --config accepts); printed and written by every run.
nlohmann::json to_json(const MoeConfig& config);
void print_config(const MoeConfig& config, std::FILE* out = stdout);

// Convenience for tests and simple tools: defaults, flags, normalize(), validate().
MoeConfig parse_moe_config(const std::vector<std::string>& args);

}  // namespace moekit
