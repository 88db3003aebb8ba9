// A test fixture that gives each test a fresh directory of its own for the files it writes and the tools it runs:
// <temp>/moekit_test_<prefix>_<pid>_<test name>, removed after a passing test and kept after a failing one, so its
// files can be read.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>

namespace moekit::testing_util {

class ScratchDirTest : public ::testing::Test {
protected:
    explicit ScratchDirTest(std::string prefix) : prefix_(std::move(prefix)) {}
    void SetUp() override {
        dir = std::filesystem::temp_directory_path() /
              ("moekit_test_" + prefix_ + "_" + std::to_string(::getpid()) + "_" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
        std::filesystem::remove_all(dir);
        std::filesystem::create_directories(dir);
    }
    void TearDown() override {
        if (!HasFailure()) std::filesystem::remove_all(dir);
    }
    std::string path(const std::string& name) const { return (dir / name).string(); }

    std::filesystem::path dir;

private:
    std::string prefix_;
};

}  // namespace moekit::testing_util
