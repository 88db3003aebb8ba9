// FlagParser: a table of typed flags (name, field, type, default, help) turned into a command-line
// parser, a --config FILE.json reader, --help text and a JSON dump of the values. Errors are UsageError
// naming the flag and the expected type; unknown flags get the nearest known name as a suggestion.
// The MoeConfig table: src/core/moe_flags.cpp. Tests: tests/cpu/test_config.cpp.
#include "core/flags.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "moekit/error.h"

namespace moekit {

namespace {

std::string lower(std::string s) {
    for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

bool is_none(const std::string& v) { return lower(v) == "none" || lower(v) == "null"; }

int64_t parse_int(const std::string& v, const std::string& where) {
    int64_t out = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    MOEKIT_REQUIRE(!v.empty() && ec == std::errc() && end == v.data() + v.size(), where, "=", v,
                   ": expected an integer");
    return out;
}

uint64_t parse_uint(const std::string& v, const std::string& where) {
    uint64_t out = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    MOEKIT_REQUIRE(!v.empty() && ec == std::errc() && end == v.data() + v.size(), where, "=", v,
                   ": expected a non-negative integer");
    return out;
}

double parse_real(const std::string& v, const std::string& where) {
    char* end = nullptr;
    const double out = std::strtod(v.c_str(), &end);
    MOEKIT_REQUIRE(!v.empty() && !std::isspace(static_cast<unsigned char>(v[0])) && end == v.c_str() + v.size(), where,
                   "=", v, ": expected a number");
    return out;
}

bool parse_bool(const std::string& v, const std::string& where) {
    const std::string s = lower(v);
    if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
    if (s == "false" || s == "0" || s == "no" || s == "off") return false;
    throw UsageError(str(where, "=", v, ": expected a boolean (true or false)"));
}

// Lists accept "a b" (separate arguments) and "a,b".
std::vector<std::string> split_commas(const std::vector<std::string>& values) {
    std::vector<std::string> out;
    for (const auto& v : values) {
        std::stringstream ss(v);
        std::string item;
        while (std::getline(ss, item, ','))
            if (!item.empty()) out.push_back(item);
    }
    return out;
}

std::string fmt_real(double v) {
    std::ostringstream os;
    os.precision(17);
    os << v;
    std::string s = os.str();
    // Prefer the short form when it reads back exactly (0.02, not 0.020000000000000000).
    for (int p = 1; p <= 17; ++p) {
        std::ostringstream o;
        o.precision(p);
        o << v;
        if (std::strtod(o.str().c_str(), nullptr) == v) return o.str();
    }
    return s;
}

size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        cur[0] = i;
        for (size_t j = 1; j <= b.size(); ++j)
            cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
        std::swap(prev, cur);
    }
    return prev[b.size()];
}

std::string field_of(const std::string& name) {
    std::string f = name.substr(name.find_first_not_of('-'));
    std::replace(f.begin(), f.end(), '-', '_');
    return f;
}

// JSON value -> the strings the command line would have given.
std::vector<std::string> json_tokens(const nlohmann::json& v) {
    if (v.is_null()) return {"none"};
    if (v.is_boolean()) return {v.get<bool>() ? "true" : "false"};
    if (v.is_string()) return {v.get<std::string>()};
    if (v.is_number_float()) return {fmt_real(v.get<double>())};
    if (v.is_number()) return {v.dump()};
    if (v.is_array()) {
        std::vector<std::string> out;
        for (const auto& item : v) {
            auto t = json_tokens(item);
            out.insert(out.end(), t.begin(), t.end());
        }
        return out;
    }
    return {v.dump()};
}

}  // namespace

FlagParser::FlagParser(std::string usage) : usage_(std::move(usage)) {}

FlagParser::Flag& FlagParser::insert(Flag flag) {
    MOEKIT_CHECK(flag.name.rfind("--", 0) == 0, "flag names start with --: ", flag.name);
    MOEKIT_CHECK(!by_name_.count(flag.name), "flag registered twice: ", flag.name);
    if (flag.field.empty()) flag.field = field_of(flag.name);
    flag.section = section_;
    by_name_[flag.name] = flags_.size();
    flags_.push_back(std::move(flag));
    return flags_.back();
}

#define MOEKIT_FLAG_BEGIN(KIND, TYPE) \
    Flag f;                           \
    f.name = name;                    \
    f.kind = Kind::KIND;              \
    f.type = TYPE;                    \
    f.help = help;

FlagParser::Flag& FlagParser::add(const std::string& name, bool* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(boolean, "bool")
    f.default_value = *target ? "true" : "false";
    f.set = [target, name](const std::vector<std::string>& v) { *target = parse_bool(v.at(0), name); };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, int64_t* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(integer, "int")
    f.default_value = std::to_string(*target);
    f.set = [target, name](const std::vector<std::string>& v) { *target = parse_int(v.at(0), name); };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, uint64_t* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(unsigned_integer, "uint")
    f.default_value = std::to_string(*target);
    f.set = [target, name](const std::vector<std::string>& v) { *target = parse_uint(v.at(0), name); };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, double* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(real, "float")
    f.default_value = fmt_real(*target);
    f.set = [target, name](const std::vector<std::string>& v) { *target = parse_real(v.at(0), name); };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, std::string* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(text, "str")
    f.default_value = target->empty() ? "\"\"" : *target;
    f.set = [target](const std::vector<std::string>& v) { *target = v.at(0); };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, std::optional<int64_t>* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(integer, "int|None")
    f.optional = true;
    f.default_value = *target ? std::to_string(**target) : "None";
    f.set = [target, name](const std::vector<std::string>& v) {
        if (is_none(v.at(0)))
            target->reset();
        else
            *target = parse_int(v.at(0), name);
    };
    f.get = [target] { return *target ? nlohmann::json(**target) : nlohmann::json(nullptr); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, std::optional<double>* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(real, "float|None")
    f.optional = true;
    f.default_value = *target ? fmt_real(**target) : "None";
    f.set = [target, name](const std::vector<std::string>& v) {
        if (is_none(v.at(0)))
            target->reset();
        else
            *target = parse_real(v.at(0), name);
    };
    f.get = [target] { return *target ? nlohmann::json(**target) : nlohmann::json(nullptr); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, std::optional<std::string>* target,
                                  const std::string& help) {
    MOEKIT_FLAG_BEGIN(text, "str|None")
    f.optional = true;
    f.default_value = *target ? **target : "None";
    f.set = [target](const std::vector<std::string>& v) {
        if (is_none(v.at(0)))
            target->reset();
        else
            *target = v.at(0);
    };
    f.get = [target] { return *target ? nlohmann::json(**target) : nlohmann::json(nullptr); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, std::vector<std::string>* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(text_list, "str...")
    std::string d;
    for (const auto& s : *target) d += (d.empty() ? "" : " ") + s;
    f.default_value = d;
    f.set = [target, name](const std::vector<std::string>& v) {
        auto items = split_commas(v);
        MOEKIT_REQUIRE(!items.empty(), name, ": expected one or more values");
        *target = items;
    };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add(const std::string& name, std::vector<double>* target, const std::string& help) {
    MOEKIT_FLAG_BEGIN(real_list, "float...")
    std::string d;
    for (double x : *target) d += (d.empty() ? "" : " ") + fmt_real(x);
    f.default_value = d;
    f.set = [target, name](const std::vector<std::string>& v) {
        auto items = split_commas(v);
        MOEKIT_REQUIRE(!items.empty(), name, ": expected one or more numbers");
        std::vector<double> out;
        for (const auto& s : items) out.push_back(parse_real(s, name));
        *target = out;
    };
    f.get = [target] { return nlohmann::json(*target); };
    return insert(std::move(f));
}

FlagParser::Flag& FlagParser::add_action(const std::string& name, std::function<void()> action,
                                         const std::string& help) {
    MOEKIT_FLAG_BEGIN(action, "")
    f.set = [action = std::move(action), name](const std::vector<std::string>& v) {
        // An action flag may be given as --flag, --flag=true (JSON: true), or false/null (does nothing).
        if (v.empty() || parse_bool(v[0], name)) action();
    };
    return insert(std::move(f));
}
#undef MOEKIT_FLAG_BEGIN

void FlagParser::add_unsupported(const std::string& name, const std::string& why) {
    Flag f;
    f.name = name;
    f.kind = Kind::unsupported;
    f.help = why;
    f.set = [name, why](const std::vector<std::string>&) {
        throw UsageError(str(name, ": not supported yet by moekit", why.empty() ? "" : " (" + why + ")"));
    };
    insert(std::move(f));
}

const FlagParser::Flag* FlagParser::find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &flags_[it->second];
}

FlagParser::Flag* FlagParser::lookup(const std::string& name) {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &flags_[it->second];
}

FlagParser::Flag* FlagParser::lookup_key(const std::string& key) {
    for (auto& f : flags_)
        if (f.field == key || f.name.substr(2) == key) return &f;
    return nullptr;
}

std::string FlagParser::nearest(const std::string& name) const {
    std::string best;
    size_t best_d = std::max<size_t>(3, name.size() / 4) + 1;
    for (const auto& f : flags_) {
        const size_t d = edit_distance(name, f.name);
        if (d < best_d) best_d = d, best = f.name;
    }
    return best;
}

void FlagParser::apply(Flag& flag, const std::vector<std::string>& values, const std::string& where) {
    flag.set(values);
    set_flags_[flag.name] = where;
    given_[flag.name] = values;
}

std::string FlagParser::where_set(const std::string& name) const {
    auto it = set_flags_.find(name);
    return it == set_flags_.end() ? "" : it->second;
}

const std::vector<std::string>* FlagParser::given(const std::string& name) const {
    auto it = given_.find(name);
    return it == given_.end() ? nullptr : &it->second;
}

void FlagParser::apply_json(const nlohmann::json& object, const std::string& source) {
    MOEKIT_REQUIRE(object.is_object(), source, ": expected a JSON object {\"flag-name\": value, ...}");
    std::map<std::string, std::string> keys_of_flag;  // a flag named twice (field name and flag name)
    for (const auto& [key, value] : object.items()) {
        Flag* flag = lookup_key(key);
        if (!flag) {
            std::string near = nearest("--" + key);
            throw UsageError(str(source, ": unknown key '", key, "'",
                                 near.empty() ? "" : str(" (did you mean '", field_of(near), "'?)")));
        }
        if (auto [it, fresh] = keys_of_flag.emplace(flag->name, key); !fresh)
            throw UsageError(str(source, ": keys '", it->second, "' and '", key, "' both set ", flag->name,
                                 ": give it once"));
        // A refused Megatron flag at its inert value (false / null) asks for nothing moekit lacks.
        if (flag->kind == Kind::unsupported && (value.is_null() || (value.is_boolean() && !value.get<bool>())))
            continue;
        const bool list = flag->kind == Kind::text_list || flag->kind == Kind::real_list;
        MOEKIT_REQUIRE(list || !value.is_array(), source, ": ", key, ": expected a single ", flag->type, ", got ",
                       value.dump());
        MOEKIT_REQUIRE(!value.is_object(), source, ": ", key, ": expected ", flag->type, ", got ", value.dump());
        MOEKIT_REQUIRE(!value.is_null() || flag->optional || flag->kind == Kind::action, source, ": ", key,
                       ": null is not allowed (expected ", flag->type, ")");
        try {
            apply(
                *flag,
                value.is_null() && flag->kind == Kind::action ? std::vector<std::string>{"false"} : json_tokens(value),
                source);
        } catch (const UsageError& e) {
            throw UsageError(str(source, ": ", e.what()));
        }
    }
}

void FlagParser::apply_json_file(const std::string& path) {
    std::error_code ec;
    MOEKIT_REQUIRE(!std::filesystem::is_directory(path, ec), "--config ", path, ": is a directory, not a JSON file");
    std::ifstream in(path);
    MOEKIT_REQUIRE(in.good(), "--config ", path, ": cannot open the file");
    nlohmann::json object;
    // nlohmann keeps the last of two equal keys silently: catch a repeated key while parsing.
    std::string repeated;
    std::set<std::string> keys;
    nlohmann::json::parser_callback_t on_event = [&](int depth, nlohmann::json::parse_event_t event,
                                                     nlohmann::json& parsed) {
        if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string() &&
            !keys.insert(parsed.get<std::string>()).second && repeated.empty())
            repeated = parsed.get<std::string>();
        return true;
    };
    try {
        object = nlohmann::json::parse(in, on_event);
    } catch (const nlohmann::json::exception& e) {
        throw UsageError(str("--config ", path, ": not valid JSON: ", e.what()));
    }
    MOEKIT_REQUIRE(repeated.empty(), "--config ", path, ": key '", repeated, "' appears twice: give it once");
    apply_json(object, path);
}

bool FlagParser::parse(const std::vector<std::string>& args) {
    for (const auto& a : args)
        if (a == "--help" || a == "-h") {
            std::fputs(help().c_str(), stdout);
            return false;
        }
    // --config first, so that explicit flags override the file whatever their order.
    std::vector<std::string> rest;
    for (size_t i = 0; i < args.size(); ++i) {
        if (args[i] == "--config") {
            MOEKIT_REQUIRE(i + 1 < args.size(), "--config: expects a JSON file name");
            apply_json_file(args[++i]);
        } else if (args[i].rfind("--config=", 0) == 0) {
            apply_json_file(args[i].substr(9));
        } else {
            rest.push_back(args[i]);
        }
    }
    std::map<std::string, std::string> seen;  // flag -> how it was first given on the command line
    for (size_t i = 0; i < rest.size(); ++i) {
        const std::string& arg = rest[i];
        MOEKIT_REQUIRE(arg.rfind("-", 0) == 0, "unexpected argument '", arg, "' (flags start with --)");
        std::string name = arg;
        std::optional<std::string> inline_value;
        if (auto eq = arg.find('='); eq != std::string::npos) {
            name = arg.substr(0, eq);
            inline_value = arg.substr(eq + 1);
        }
        Flag* flag = lookup(name);
        bool negated = false;
        if (!flag && name.rfind("--no-", 0) == 0) {
            Flag* positive = lookup("--" + name.substr(5));
            if (positive && (positive->kind == Kind::boolean || positive->kind == Kind::unsupported)) {
                flag = positive, negated = true;
            }
        }
        if (!flag) {
            const std::string near = nearest(name);
            throw UsageError(str("unknown flag ", name, near.empty() ? "" : str(" (did you mean ", near, "?)")));
        }
        if (flag->kind == Kind::unsupported) flag->set({});
        if (auto [it, fresh] = seen.emplace(flag->name, name); !fresh)
            throw UsageError(str(flag->name, " is given twice on the command line",
                                 it->second != name ? str(" (as ", it->second, " and ", name, ")") : std::string(),
                                 ": give it once (the last one would silently win)"));
        std::vector<std::string> values;
        if (negated) {
            MOEKIT_REQUIRE(!inline_value, name, ": takes no value");
            values = {"false"};
        } else if (inline_value) {
            values = {*inline_value};
        } else if (flag->kind == Kind::boolean) {
            values = {"true"};
        } else if (flag->kind == Kind::action) {
            values = {};
        } else {
            // Values never start with "--" (a negative number starts with a single dash).
            auto is_value = [&](size_t j) { return j < rest.size() && rest[j].rfind("--", 0) != 0; };
            MOEKIT_REQUIRE(is_value(i + 1), name, ": expects a value (", flag->type, ")");
            values.push_back(rest[++i]);
            if (flag->kind == Kind::text_list || flag->kind == Kind::real_list)
                while (is_value(i + 1)) values.push_back(rest[++i]);
        }
        apply(*flag, values, "command line");
    }
    for (const auto& rule : rules_) rule(*this);
    return true;
}

std::string FlagParser::help() const {
    std::ostringstream os;
    os << "usage: " << usage_ << "\n";
    std::string section;
    std::vector<std::string> unsupported;
    for (const auto& f : flags_) {
        if (f.kind == Kind::unsupported) {
            unsupported.push_back(f.name);
            continue;
        }
        if (f.section != section) os << "\n" << (section = f.section) << ":\n";
        std::string head = "  " + f.name + (f.kind == Kind::boolean || f.kind == Kind::action ? "" : " " + f.type);
        os << head;
        if (head.size() < 46)
            os << std::string(46 - head.size(), ' ');
        else
            os << "\n" << std::string(46, ' ');
        os << f.help;
        if (f.kind != Kind::action) os << " [default: " << f.default_value << "]";
        os << "\n";
    }
    os << "\n  --config FILE.json                          flags from a JSON object (keys: flag names without dashes "
          "or "
          "field names); explicit flags override it\n"
          "  --help                                      this list\n";
    if (!unsupported.empty()) {
        os << "\nMegatron flags that moekit refuses (not supported yet):\n ";
        size_t col = 1;
        for (const auto& u : unsupported) {
            if (col + u.size() + 1 > 110) os << "\n ", col = 1;
            os << " " << u;
            col += u.size() + 1;
        }
        os << "\n";
    }
    return os.str();
}

nlohmann::json FlagParser::values() const {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& f : flags_)
        if (f.get) out[f.field] = f.get();
    return out;
}

}  // namespace moekit
