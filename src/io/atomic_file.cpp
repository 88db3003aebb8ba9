// write_file_atomically / replace_directory (see atomic_file.h): temp file + fsync + rename.
#include "io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "moekit/error.h"

namespace moekit::io {

void write_file_atomically(const std::string& path, std::string_view bytes) {
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MOEKIT_REQUIRE(fd >= 0, path, ": cannot write (", std::strerror(errno), ")");
    size_t done = 0;
    int err = 0;
    while (done < bytes.size()) {
        const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
        if (n < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        done += size_t(n);
    }
    if (err == 0 && ::fsync(fd) != 0) err = errno;
    if (::close(fd) != 0 && err == 0) err = errno;
    if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
    if (err != 0) {
        ::unlink(tmp.c_str());
        throw UsageError(str(path, ": write failed (", std::strerror(err), "); the file was left as it was"));
    }
}

void replace_directory(const std::string& tmp_path, const std::string& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const std::string old = path + ".old." + std::to_string(::getpid());
    const bool existed = fs::exists(path, ec);
    if (existed) {
        fs::rename(path, old, ec);
        MOEKIT_REQUIRE(!ec, path, ": cannot replace (", ec.message(), ")");
    }
    fs::rename(tmp_path, path, ec);
    if (ec) {
        if (existed) fs::rename(old, path, ec);
        throw UsageError(str(path, ": cannot move ", tmp_path, " into place"));
    }
    if (existed) fs::remove_all(old, ec);
}

}  // namespace moekit::io
