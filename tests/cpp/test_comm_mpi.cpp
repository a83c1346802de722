// main() of ringflash_comm_mpi_tests: test_comm.cpp's cases over MPI ranks, one per process.
//   mpiexec --oversubscribe -n 4 build/tests/cpp/ringflash_comm_mpi_tests
//
// Every process runs the same tests in the same order (each on a fresh mpi_world()). Rank 0 prints
// GoogleTest's usual report; the other ranks print only their failures, marked with their rank. The
// exit status is 0 only if every rank passed.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace {

// Prints each failed assertion of this rank, marked with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // The name is kept here: OnTestPartResult runs under GoogleTest's lock, which
  // current_test_info() would take again.
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: %s\n", rank_, test_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(), result.message());
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    // MPI first: the test list depends on the job's size.
    std::unique_ptr<ringflash::Communicator> world = ringflash::mpi_world();
    ::testing::InitGoogleTest(&argc, argv);
    if (world->rank() != 0) {
      ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter(world->rank()));
    }
    int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    std::vector<int> every(static_cast<size_t>(world->size()));
    world->all_gather(&failed, every.data(), std::vector<size_t>(every.size(), sizeof(int)));
    int failed_ranks = 0;
    for (int f : every) failed_ranks += f;
    if (world->rank() == 0 && failed_ranks > 0) std::fprintf(stderr, "%d of %d ranks failed\n", failed_ranks, world->size());
    return failed_ranks == 0 ? 0 : 1;
  } catch (const ringflash::Error& e) {
    std::fprintf(stderr, "ringflash_comm_mpi_tests: %s\n", e.what());
    return 1;
  }
}
