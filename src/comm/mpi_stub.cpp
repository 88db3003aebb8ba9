// The MPI entry points of include/moekit/comm.h in a build without MPI (CMake found none): MPI runs
// are refused with a message that says what is missing. With MPI: src/comm/mpi_comm.cpp.
#include <cstdlib>

#include "moekit/comm.h"
#include "moekit/error.h"

namespace moekit::comm {

Communicator& mpi_world() {
    throw UsageError(
        "this moekit was built without MPI, so it cannot run under mpirun (install libopenmpi-dev and "
        "openmpi-bin, then re-run cmake), or use --virtual-ranks N to run N ranks in one process");
}

bool mpi_active() { return false; }
std::string mpi_rank_label() { return ""; }
void abort_job(int exit_code) { std::exit(exit_code); }

}  // namespace moekit::comm
