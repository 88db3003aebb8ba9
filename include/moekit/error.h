// moekit::Error and the checking macros. Library code throws; only tools/main.cpp catches,
// prints one line and exits (status 2 for user errors such as bad flags or files).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace moekit {

// A failure inside the engine (a broken precondition, a CUDA/NCCL/MPI error).
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Bad input from the user (flag, config file, weight file): the program exits with status 2.
class UsageError : public Error {
public:
    using Error::Error;
};

// Concatenate anything streamable into a string: str("--moe-router-topk=", k, " must ...").
template <typename... Args>
std::string str(Args&&... args) {
    std::ostringstream os;
    (os << ... << std::forward<Args>(args));
    return os.str();
}

}  // namespace moekit

// Precondition inside the engine; the message says what was expected.
#define MOEKIT_CHECK(cond, ...)                                                                  \
    do {                                                                                         \
        if (!(cond))                                                                             \
            throw ::moekit::Error(::moekit::str(__FILE__, ":", __LINE__, ": check failed: ", #cond, \
                                                ": ", __VA_ARGS__));                             \
    } while (0)

// User-facing rule: throws UsageError with exactly the message given.
#define MOEKIT_REQUIRE(cond, ...)                                     \
    do {                                                              \
        if (!(cond)) throw ::moekit::UsageError(::moekit::str(__VA_ARGS__)); \
    } while (0)
