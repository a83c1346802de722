// Communicator tests: every op at every world size, uneven splits, 2D layouts from split, stats,
// and faults (deadlines, a rank that throws, returns early or calls fail()).
//
// One source, two transports. Built into ringflash_comm_tests it runs each case over inproc ranks at
// world sizes 1, 2, 3, 4 and 8. Built into ringflash_comm_mpi_tests (RINGFLASH_TEST_MPI=1, with
// test_comm_mpi.cpp for main) it runs each case once, at the size of the MPI job, on a fresh
// mpi_world(): each process is one rank, and checks what that rank saw.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.h"
#include "ringflash/capabilities.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

#ifndef RINGFLASH_TEST_MPI
#define RINGFLASH_TEST_MPI 0
#endif

namespace ringflash::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Rank = std::function<void(Communicator&)>;

constexpr const char* kTransport = RINGFLASH_TEST_MPI ? "mpi" : "inproc";
// Long enough never to expire in a passing case, short enough that a hang is a quick failure.
constexpr std::chrono::milliseconds kTimeout = 20s;
// The deadline of the cases that let it expire, and the most a prompt failure may take.
constexpr std::chrono::milliseconds kShortTimeout = 300ms;
constexpr double kPromptSeconds = 3.0;

std::vector<int> world_sizes() {
#if RINGFLASH_TEST_MPI
  static const int size = mpi_world()->size();
  return {size};
#else
  return {1, 2, 3, 4, 8};
#endif
}

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "(not a std::exception)";
  }
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// What one rank ended with.
struct Outcome {
  int rank;
  std::exception_ptr error;  // null when it returned normally
};

// Runs `fn` on every rank of a world of `size` ranks over the transport under test, each rank's
// communicator with deadline `timeout`, and returns the outcome of each rank this process ran: all
// of them on inproc, its own on MPI. A rank that throws fails its communicator, as run_inproc does.
std::vector<Outcome> run_world(int size, const Rank& fn, std::chrono::milliseconds timeout = kTimeout) {
#if RINGFLASH_TEST_MPI
  std::unique_ptr<Communicator> comm = mpi_world();
  EXPECT_EQ(comm->size(), size);
  comm->set_timeout(timeout);
  std::exception_ptr error;
  try {
    fn(*comm);
  } catch (...) {
    error = std::current_exception();
    comm->fail(describe(error));
  }
  return {{comm->rank(), error}};
#else
  std::vector<std::exception_ptr> errors = run_inproc_collect(size, fn, timeout);
  EXPECT_EQ(errors.size(), static_cast<size_t>(size));
  std::vector<Outcome> outcomes;
  for (size_t r = 0; r < errors.size(); ++r) outcomes.push_back({static_cast<int>(r), errors[r]});
  return outcomes;
#endif
}

// Runs `fn` on every rank and expects every rank to succeed.
void run_ok(int size, const Rank& fn) {
  for (const Outcome& o : run_world(size, fn))
    if (o.error) ADD_FAILURE() << "rank " << o.rank << " threw: " << describe(o.error);
}

// Expects `e` to be a CommError whose message holds each of `parts`.
void expect_comm_error(int rank, const std::exception_ptr& e, const std::vector<std::string>& parts) {
  if (!e) {
    ADD_FAILURE() << "rank " << rank << " threw nothing";
    return;
  }
  try {
    std::rethrow_exception(e);
  } catch (const CommError& x) {
    const std::string message = x.what();
    for (const std::string& p : parts)
      EXPECT_NE(message.find(p), std::string::npos) << "rank " << rank << ": the message lacks \"" << p << "\":\n  "
                                                    << message;
  } catch (...) {
    ADD_FAILURE() << "rank " << rank << " threw something other than a CommError: " << describe(e);
  }
}

// Byte i of the message number `n` from rank `src` to rank `dst`.
unsigned char pattern(int src, int dst, int n, size_t i) {
  return static_cast<unsigned char>(src * 37 + dst * 11 + n * 5 + static_cast<int>(i));
}

std::vector<unsigned char> message(int src, int dst, int n, size_t bytes) {
  std::vector<unsigned char> m(bytes);
  for (size_t i = 0; i < bytes; ++i) m[i] = pattern(src, dst, n, i);
  return m;
}

class Comm : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
};

INSTANTIATE_TEST_SUITE_P(WorldSizes, Comm, ::testing::ValuesIn(world_sizes()),
                         [](const ::testing::TestParamInfo<int>& info) { return "P" + std::to_string(info.param); });

TEST_P(Comm, RankSizeAndTransport) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    EXPECT_EQ(c.size(), p);
    EXPECT_EQ(c.transport(), kTransport);
    EXPECT_EQ(c.timeout(), kTimeout);
    const int me = c.rank();
    std::vector<int> ranks(static_cast<size_t>(p), -1);
    c.all_gather(&me, ranks.data(), std::vector<size_t>(ranks.size(), sizeof(int)));
    for (int j = 0; j < p; ++j) EXPECT_EQ(ranks[j], j);
  });
}

// Three messages to the right neighbour in two calls, of 0, 7 and 1000 bytes; the second call is
// waited first, and the send buffers are overwritten before any wait.
TEST_P(Comm, SendRecvMatchesInPostingOrder) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank(), right = (me + 1) % p, left = (me + p - 1) % p;
    const size_t sizes[3] = {0, 7, 1000};
    std::vector<unsigned char> out[3], in[3];
    for (int n = 0; n < 3; ++n) {
      out[n] = message(me, right, n, sizes[n]);
      in[n].assign(sizes[n], 0xEE);
    }
    std::unique_ptr<CommRequest> first =
        c.send_recv({send_op(right, out[0].data(), sizes[0]), recv_op(left, in[0].data(), sizes[0]),
                     send_op(right, out[1].data(), sizes[1]), recv_op(left, in[1].data(), sizes[1])});
    std::unique_ptr<CommRequest> second =
        c.send_recv({recv_op(left, in[2].data(), sizes[2]), send_op(right, out[2].data(), sizes[2])});
    for (auto& o : out) std::fill(o.begin(), o.end(), 0);  // the CPU transports copy sends when posted
    second->wait();
    first->wait();
    for (int n = 0; n < 3; ++n) EXPECT_EQ(in[n], message(left, me, n, sizes[n])) << "message " << n;
  });
}

// 4 MiB + 3 bytes each way around the ring (over MPI, past the eager limit), and to itself.
TEST_P(Comm, LargeMessages) {
  const int p = world();
  constexpr size_t kBytes = (size_t{4} << 20) + 3;
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank(), right = (me + 1) % p, left = (me + p - 1) % p;
    const std::vector<unsigned char> to_right = message(me, right, 1, kBytes), to_me = message(me, me, 2, kBytes);
    std::vector<unsigned char> from_left(kBytes), from_me(kBytes);
    c.send_recv({send_op(right, to_right.data(), kBytes), recv_op(left, from_left.data(), kBytes),
                 send_op(me, to_me.data(), kBytes), recv_op(me, from_me.data(), kBytes)})
        ->wait();
    EXPECT_TRUE(from_left == message(left, me, 1, kBytes));
    EXPECT_TRUE(from_me == to_me);
  });
}

TEST_P(Comm, MessagesToSelfAndZeroBytes) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank();
    const std::vector<unsigned char> out = message(me, me, 0, 16);
    std::vector<unsigned char> in(16, 0xEE);
    std::vector<P2POp> ops = {recv_op(me, in.data(), in.size()), send_op(me, out.data(), out.size()),
                              send_op(me, nullptr, 0), recv_op(me, nullptr, 0)};
    for (int j = 0; j < p; ++j) {
      if (j == me) continue;
      ops.push_back(send_op(j, nullptr, 0));
      ops.push_back(recv_op(j, nullptr, 0));
    }
    c.reset_stats();
    c.send_recv(ops)->wait();
    EXPECT_EQ(in, out);
    EXPECT_EQ(c.stats().bytes_sent, 0u);
  });
}

// Rank r sends ((r + 2j) % 3) * 5 bytes to rank j, so some parts are empty; the parts sit at
// offsets with gaps (send) and in reverse rank order (recv), and the gaps stay untouched.
TEST_P(Comm, AllToAllUneven) {
  const int p = world();
  constexpr size_t kGap = 3;
  constexpr unsigned char kUntouched = 0xEE;
  auto bytes = [](int src, int dst) { return static_cast<size_t>(((src + 2 * dst) % 3) * 5); };
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank();
    std::vector<size_t> send_bytes(p), send_offsets(p), recv_bytes(p), recv_offsets(p);
    size_t send_end = 0, recv_end = 0, to_others = 0;
    for (int j = 0; j < p; ++j) {
      send_bytes[j] = bytes(me, j);
      send_offsets[j] = send_end + kGap;
      send_end = send_offsets[j] + send_bytes[j];
      if (j != me) to_others += send_bytes[j];
    }
    for (int j = p - 1; j >= 0; --j) {
      recv_bytes[j] = bytes(j, me);
      recv_offsets[j] = recv_end + kGap;
      recv_end = recv_offsets[j] + recv_bytes[j];
    }
    std::vector<unsigned char> send(send_end + kGap, kUntouched), recv(recv_end + kGap, kUntouched);
    for (int j = 0; j < p; ++j)
      for (size_t i = 0; i < send_bytes[j]; ++i) send[send_offsets[j] + i] = pattern(me, j, 0, i);

    c.reset_stats();
    c.all_to_all(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets);
    EXPECT_EQ(c.stats().bytes_sent, to_others);

    std::vector<unsigned char> expected(recv.size(), kUntouched);
    for (int j = 0; j < p; ++j)
      for (size_t i = 0; i < recv_bytes[j]; ++i) expected[recv_offsets[j] + i] = pattern(j, me, 0, i);
    EXPECT_EQ(recv, expected);
  });
}

// Rank j contributes (j % 3) * 4 bytes: rank 0 nothing. Once from a separate buffer, once in place.
TEST_P(Comm, AllGatherUneven) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank();
    std::vector<size_t> bytes(p), offsets(p);
    size_t total = 0;
    for (int j = 0; j < p; ++j) {
      bytes[j] = static_cast<size_t>(j % 3) * 4;
      offsets[j] = total;
      total += bytes[j];
    }
    std::vector<unsigned char> expected(total + 1, 0xEE);
    for (int j = 0; j < p; ++j)
      for (size_t i = 0; i < bytes[j]; ++i) expected[offsets[j] + i] = pattern(j, 0, 0, i);

    const std::vector<unsigned char> mine = message(me, 0, 0, bytes[me]);
    std::vector<unsigned char> recv(total + 1, 0xEE);
    c.reset_stats();
    c.all_gather(mine.data(), recv.data(), bytes);
    EXPECT_EQ(recv, expected);
    EXPECT_EQ(c.stats().bytes_sent, bytes[me] * static_cast<size_t>(p - 1));

    std::vector<unsigned char> in_place(total + 1, 0xEE);
    std::copy(mine.begin(), mine.end(), in_place.begin() + static_cast<std::ptrdiff_t>(offsets[me]));
    c.all_gather(in_place.data() + offsets[me], in_place.data(), bytes);
    EXPECT_EQ(in_place, expected);
  });
}

// Values of very different magnitudes, so that the order of the sum shows in the bits.
std::vector<float> reduce_input(int rank, size_t count) {
  std::mt19937 rng(1000 + rank);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<float> x(count);
  for (float& v : x) v = std::ldexp(mantissa(rng), exponent(rng));
  return x;
}

std::vector<uint32_t> bits(const float* x, size_t n) {
  std::vector<uint32_t> b(n);
  for (size_t i = 0; i < n; ++i) std::memcpy(&b[i], &x[i], sizeof(float));
  return b;
}

TEST_P(Comm, ReduceScatterSumsInRankOrder) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank();
    std::vector<size_t> counts(p), offsets(p);
    size_t total = 0;
    for (int j = 0; j < p; ++j) {
      counts[j] = static_cast<size_t>((j * 3) % 4) * 50;  // rank 0 (and 4) keep nothing
      offsets[j] = total;
      total += counts[j];
    }
    // ((x_0 + x_1) + x_2) + ... over this rank's block.
    std::vector<float> expected(counts[me]);
    for (int j = 0; j < p; ++j) {
      const std::vector<float> x = reduce_input(j, total);
      for (size_t e = 0; e < counts[me]; ++e)
        expected[e] = j == 0 ? x[offsets[me] + e] : expected[e] + x[offsets[me] + e];
    }
    const std::vector<float> send = reduce_input(me, total);
    for (int run = 0; run < 2; ++run) {
      std::vector<float> recv(counts[me] + 1, -7.0f);
      c.reset_stats();
      c.reduce_scatter(send.data(), recv.data(), counts);
      EXPECT_EQ(bits(recv.data(), expected.size()), bits(expected.data(), expected.size())) << "run " << run;
      EXPECT_EQ(recv.back(), -7.0f);
      EXPECT_EQ(c.stats().bytes_sent, (total - counts[me]) * sizeof(float));
    }
  });
}

// The last rank enters the barrier 100 ms late; nobody leaves before it arrives, and the wait shows
// in stats.
TEST_P(Comm, BarrierWaitsForTheLastRank) {
  const int p = world();
  constexpr auto kLate = 100ms;
  constexpr double kAtLeast = 0.05;  // scheduling may shift the ranks' start by some milliseconds
  run_ok(p, [&](Communicator& c) {
    c.barrier();
    if (c.rank() == p - 1) std::this_thread::sleep_for(kLate);
    c.reset_stats();
    const Clock::time_point start = Clock::now();
    c.barrier();
    if (c.rank() != p - 1) {
      EXPECT_GE(seconds_since(start), kAtLeast);
      EXPECT_GE(c.stats().wait_seconds, kAtLeast);
    }
    EXPECT_EQ(c.stats().bytes_sent, 0u);
  });
}

TEST_P(Comm, StatsCountBytesToOtherRanksOnly) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank(), right = (me + 1) % p, left = (me + p - 1) % p;
    std::vector<unsigned char> self_out(100, 1), self_in(100), out(40, 2), in(40);
    c.reset_stats();
    c.send_recv({send_op(me, self_out.data(), 100), recv_op(me, self_in.data(), 100), send_op(right, out.data(), 40),
                 recv_op(left, in.data(), 40)})
        ->wait();
    EXPECT_EQ(c.stats().bytes_sent, p > 1 ? 40u : 0u);
    EXPECT_GE(c.stats().wait_seconds, 0.0);
    c.reset_stats();
    EXPECT_EQ(c.stats().bytes_sent, 0u);
    EXPECT_EQ(c.stats().wait_seconds, 0.0);
  });
}

// Every ring and every all_to_all pattern on one communicator: the checks the 2D tests run on each
// of their sub-communicators. `tag` makes the data of different communicators differ.
void exercise(Communicator& c, int tag) {
  const int p = c.size(), me = c.rank();
  std::vector<int> ranks(static_cast<size_t>(p), -1);
  const int mine = tag * 1000 + me;
  c.all_gather(&mine, ranks.data(), std::vector<size_t>(ranks.size(), sizeof(int)));
  for (int j = 0; j < p; ++j) EXPECT_EQ(ranks[j], tag * 1000 + j);

  std::vector<int> send(static_cast<size_t>(p)), recv(static_cast<size_t>(p), -1);
  for (int j = 0; j < p; ++j) send[j] = tag * 10000 + me * 100 + j;
  std::vector<size_t> bytes(static_cast<size_t>(p), sizeof(int)), offsets(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) offsets[j] = static_cast<size_t>(j) * sizeof(int);
  c.all_to_all(send.data(), bytes, offsets, recv.data(), bytes, offsets);
  for (int j = 0; j < p; ++j) EXPECT_EQ(recv[j], tag * 10000 + j * 100 + me);

  std::vector<float> x(static_cast<size_t>(p), static_cast<float>(tag));
  float sum = -1.0f;
  c.reduce_scatter(x.data(), &sum, std::vector<size_t>(static_cast<size_t>(p), 1));
  EXPECT_EQ(sum, static_cast<float>(tag * p));

  const int right = (me + 1) % p, left = (me + p - 1) % p;
  int from_left = -1;
  c.send_recv({send_op(right, &mine, sizeof(int)), recv_op(left, &from_left, sizeof(int))})->wait();
  EXPECT_EQ(from_left, tag * 1000 + left);
  c.barrier();
}

// Every (rows x cols) grid of the world: a row communicator (ranks of one row, by column) and a
// column communicator (ranks of one column, by row), with every op on both, interleaved.
TEST_P(Comm, SplitIntoEveryGrid) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank();
    for (int rows = 1; rows <= p; ++rows) {
      if (p % rows != 0) continue;
      const int cols = p / rows, row = me / cols, col = me % cols;
      std::unique_ptr<Communicator> row_comm = c.split(row, col);
      std::unique_ptr<Communicator> col_comm = c.split(col, row);
      ASSERT_EQ(row_comm->size(), cols);
      ASSERT_EQ(col_comm->size(), rows);
      EXPECT_EQ(row_comm->rank(), col);
      EXPECT_EQ(col_comm->rank(), row);
      EXPECT_EQ(row_comm->transport(), kTransport);
      EXPECT_EQ(row_comm->timeout(), c.timeout());
      SCOPED_TRACE(testing::Message() << rows << " x " << cols);
      exercise(*row_comm, 1 + row);
      exercise(*col_comm, 100 + col);
      exercise(c, 7);
      exercise(*row_comm, 2 + row);
    }
  });
}

// Ranks are ordered by (key, parent rank): descending keys reverse them, equal keys keep the
// parent's order, and a split of a split works.
TEST_P(Comm, SplitOrdersByKeyThenRank) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    const int me = c.rank();
    std::unique_ptr<Communicator> reversed = c.split(0, p - 1 - me);
    EXPECT_EQ(reversed->rank(), p - 1 - me);
    exercise(*reversed, 3);

    std::unique_ptr<Communicator> parity = c.split(me % 2, 0);
    EXPECT_EQ(parity->rank(), me / 2);
    EXPECT_EQ(parity->size(), (p - me % 2 + 1) / 2);
    exercise(*parity, 4 + me % 2);

    std::unique_ptr<Communicator> single = parity->split(parity->rank(), 0);
    EXPECT_EQ(single->size(), 1);
    EXPECT_EQ(single->rank(), 0);
    exercise(*single, 6);
  });
}

TEST_P(Comm, SplitRejectsANegativeColorOnEveryRank) {
  const int p = world();
  for (const Outcome& o : run_world(p, [&](Communicator& c) { c.split(c.rank() == p - 1 ? -1 : 0, 0); })) {
    EXPECT_TRUE(o.error) << "rank " << o.rank;
    if (o.error)
      EXPECT_RINGFLASH_ERROR(InvalidArgument, std::rethrow_exception(o.error), "[split] color must be >= 0, got -1",
                             "from rank " + std::to_string(p - 1));
  }
}

TEST_P(Comm, BadArgumentsNameTheOpAndArgument) {
  const int p = world();
  run_ok(p, [&](Communicator& c) {
    int x = 0;
    EXPECT_RINGFLASH_ERROR(InvalidArgument, c.send_recv({send_op(p, &x, sizeof(x))}), "[send_recv]", "ops[0].peer",
                           "[0, " + std::to_string(p) + ")", "got " + std::to_string(p));
    EXPECT_RINGFLASH_ERROR(InvalidArgument, c.send_recv({recv_op(0, nullptr, 4)}), "[send_recv]", "ops[0].data");
    const std::vector<size_t> short_list(static_cast<size_t>(p) + 1, 0), ok(static_cast<size_t>(p), 0);
    EXPECT_RINGFLASH_ERROR(InvalidArgument, c.all_to_all(&x, short_list, ok, &x, ok, ok), "[all_to_all]",
                           "send_bytes", "one entry per rank (" + std::to_string(p) + ")");
    EXPECT_RINGFLASH_ERROR(InvalidArgument, c.all_gather(&x, &x, short_list), "[all_gather]", "bytes");
    EXPECT_RINGFLASH_ERROR(InvalidArgument, c.reduce_scatter(nullptr, nullptr, std::vector<size_t>(p, 1)),
                           "[reduce_scatter]", "send");
    // Nothing was posted: the communicator still works.
    c.barrier();
  });
}

// Rank 0 expects 8 bytes where rank 1 sends 4, then 4 where rank 1 sends 8: the receiver fails
// (the sender's message is gone when it was posted).
TEST_P(Comm, MismatchedSizesFailTheReceiver) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  for (const bool shorter : {true, false}) {
    SCOPED_TRACE(shorter ? "shorter message" : "longer message");
    const size_t expected = shorter ? 8 : 4, sent = shorter ? 4 : 8;
    const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
      int64_t in = 0, out = 5;
      if (c.rank() == 0) c.send_recv({recv_op(1, &in, expected)})->wait();
      if (c.rank() == 1) c.send_recv({send_op(0, &out, sent)})->wait();
    });
    for (const Outcome& o : outcomes) {
      if (o.rank != 0) {
        EXPECT_FALSE(o.error) << "rank " << o.rank << ": " << describe(o.error);
        continue;
      }
      std::vector<std::string> parts = {"[send_recv] rank 0 of " + std::to_string(p), "the message from rank 1",
                                        std::to_string(expected) + " bytes"};
      // MPI reports a message longer than its receive itself, in its own words.
      if (!shorter && RINGFLASH_TEST_MPI) parts.push_back("MPI_ERR_TRUNCATE");
      expect_comm_error(0, o.error, parts);
    }
  }
}

// Rank 0 waits for rank 1 under a 300 ms deadline while rank 1 waits for rank 0 under a long one:
// rank 0's deadline passes, and rank 1 hears of it at once instead of waiting out its own.
TEST_P(Comm, DeadlineNamesTheOpAndThePeer) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  const Clock::time_point start = Clock::now();
  std::vector<double> took(static_cast<size_t>(p), 0.0);
  const std::vector<Outcome> outcomes = run_world(
      p,
      [&](Communicator& c) {
        const Clock::time_point t = Clock::now();
        int x = 0;
        try {
          if (c.rank() == 0) {
            c.set_timeout(kShortTimeout);
            c.send_recv({recv_op(1, &x, sizeof(x))})->wait();
          } else if (c.rank() == 1) {
            c.send_recv({recv_op(0, &x, sizeof(x))})->wait();
          }
        } catch (...) {
          took[static_cast<size_t>(c.rank())] = seconds_since(t);
          throw;
        }
      },
      kTimeout);
  const std::string of = " of " + std::to_string(p) + ": ";
  for (const Outcome& o : outcomes) {
    const double t = took[static_cast<size_t>(o.rank)];
    if (o.rank == 0) {
      expect_comm_error(0, o.error, {"[send_recv] rank 0" + of + "no message from rank 1 within 0.3 s"});
      EXPECT_GE(t, 0.29);
      EXPECT_LT(t, kPromptSeconds);
    } else if (o.rank == 1) {
      expect_comm_error(1, o.error, {"[send_recv] rank 1" + of + "no message from rank 0, which failed:",
                                     "no message from rank 1 within 0.3 s"});
      EXPECT_LT(t, kPromptSeconds);
    } else {
      EXPECT_FALSE(o.error) << "rank " << o.rank << ": " << describe(o.error);
    }
  }
  EXPECT_LT(seconds_since(start), kPromptSeconds + 1.0);
}

// Every rank but the last enters a barrier under a 300 ms deadline; the last sleeps past it. The
// error is the collective's own.
TEST_P(Comm, DeadlineInACollective) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  constexpr auto kAsleep = 700ms;
  const std::vector<Outcome> outcomes = run_world(
      p,
      [&](Communicator& c) {
        if (c.rank() == p - 1) {
          std::this_thread::sleep_for(kAsleep);
          return;
        }
        c.barrier();
      },
      kShortTimeout);
  const std::string last = std::to_string(p - 1);
  for (const Outcome& o : outcomes) {
    if (o.rank == p - 1)
      EXPECT_FALSE(o.error) << describe(o.error);
    else
      expect_comm_error(o.rank, o.error,
                        {"[barrier] rank " + std::to_string(o.rank) + " of " + std::to_string(p) +
                         ": no message from rank " + last + " within 0.3 s"});
  }
}

// Rank P/2 throws before its part of an all_to_all; the others, under a long deadline, fail at once
// naming it and its error.
TEST_P(Comm, RankThatThrowsBeforeItsSend) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  const int culprit = p / 2;
  std::vector<double> took(static_cast<size_t>(p), 0.0);
  const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
    if (c.rank() == culprit) throw std::runtime_error("boom before the send");
    const Clock::time_point t = Clock::now();
    std::vector<int> send(static_cast<size_t>(p), c.rank()), recv(static_cast<size_t>(p));
    std::vector<size_t> bytes(static_cast<size_t>(p), sizeof(int)), offsets(static_cast<size_t>(p));
    for (int j = 0; j < p; ++j) offsets[j] = static_cast<size_t>(j) * sizeof(int);
    try {
      c.all_to_all(send.data(), bytes, offsets, recv.data(), bytes, offsets);
    } catch (...) {
      took[static_cast<size_t>(c.rank())] = seconds_since(t);
      throw;
    }
  });
  for (const Outcome& o : outcomes) {
    if (o.rank == culprit) {
      EXPECT_TRUE(o.error);
      if (o.error) {
        EXPECT_EQ(describe(o.error), "boom before the send");
      }
      continue;
    }
    expect_comm_error(o.rank, o.error,
                      {"[all_to_all] rank " + std::to_string(o.rank) + " of " + std::to_string(p),
                       "no message from rank " + std::to_string(culprit) + ", which failed: boom before the send"});
    EXPECT_LT(took[static_cast<size_t>(o.rank)], kPromptSeconds);
  }
}

// World rank 0 throws after a split; the others wait for it on the sub-communicator, where it has
// another rank number, and hear of its failure there.
TEST_P(Comm, FailureReachesSubCommunicators) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
    std::unique_ptr<Communicator> reversed = c.split(0, p - 1 - c.rank());
    if (c.rank() == 0) throw std::runtime_error("boom after the split");
    reversed->barrier();
  });
  for (const Outcome& o : outcomes) {
    if (o.rank == 0) continue;
    expect_comm_error(o.rank, o.error,
                      {"[barrier] rank " + std::to_string(p - 1 - o.rank) + " of " + std::to_string(p),
                       "no message from rank " + std::to_string(p - 1) + ", which failed: boom after the split"});
  }
}

// fail() with a reason: the ranks waiting on it hear the reason at once, although the failed rank
// then returns normally.
TEST_P(Comm, FailTellsThePeers) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  std::vector<double> took(static_cast<size_t>(p), 0.0);
  const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
    if (c.rank() == 1) {
      c.fail("out of disk");
      EXPECT_RINGFLASH_ERROR(CommError, c.barrier(), "[barrier] rank 1 of", "this rank has failed: out of disk");
      return;
    }
    const Clock::time_point t = Clock::now();
    try {
      c.barrier();
    } catch (...) {
      took[static_cast<size_t>(c.rank())] = seconds_since(t);
      throw;
    }
  });
  for (const Outcome& o : outcomes) {
    if (o.rank == 1) {
      EXPECT_FALSE(o.error) << describe(o.error);
      continue;
    }
    expect_comm_error(o.rank, o.error, {"[barrier]", "no message from rank 1, which failed: out of disk"});
    EXPECT_LT(took[static_cast<size_t>(o.rank)], kPromptSeconds);
  }
}

// A request dropped while an exception unwinds past it does not wait: the rank fails promptly.
TEST_P(Comm, UnwindingDoesNotWaitOutTheDeadline) {
  const int p = world();
  const Clock::time_point start = Clock::now();
  const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
    int x = 0;
    std::unique_ptr<CommRequest> pending = c.send_recv({recv_op((c.rank() + 1) % p, &x, sizeof(x))});
    throw std::runtime_error("abandoned");
  });
  EXPECT_LT(seconds_since(start), kPromptSeconds);
  for (const Outcome& o : outcomes) EXPECT_TRUE(o.error);
}

#if !RINGFLASH_TEST_MPI
// Over MPI a rank that returns early is only seen by the deadline (or by mpiexec when the process
// exits); over inproc its peers hear of it at once.
TEST_P(Comm, RankThatReturnsEarly) {
  const int p = world();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  const Clock::time_point start = Clock::now();
  const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
    if (c.rank() == p - 1) return;
    c.barrier();
  });
  EXPECT_LT(seconds_since(start), kPromptSeconds);
  for (const Outcome& o : outcomes) {
    if (o.rank == p - 1) {
      EXPECT_FALSE(o.error);
      continue;
    }
    expect_comm_error(o.rank, o.error,
                      {"[barrier]", "no message from rank " + std::to_string(p - 1) +
                                        ", which has returned without sending it"});
  }
}

// Over MPI this waits out the deadline.
TEST_P(Comm, ReceiveFromSelfWithoutASendFailsAtOnce) {
  const int p = world();
  const std::vector<Outcome> outcomes = run_world(p, [&](Communicator& c) {
    int x = 0;
    if (c.rank() == 0) c.send_recv({recv_op(0, &x, sizeof(x))})->wait();
  });
  expect_comm_error(0, outcomes[0].error, {"[send_recv] rank 0 of", "no message from rank 0 (this rank)"});
}

TEST(CommInproc, RunInprocRethrowsTheFirstErrorByRank) {
  try {
    run_inproc(4, [](Communicator& c) {
      if (c.rank() == 3) throw std::runtime_error("from rank 3");
      if (c.rank() == 1) {
        std::this_thread::sleep_for(50ms);  // rank 3's error comes first in time
        throw std::runtime_error("from rank 1");
      }
    });
    ADD_FAILURE() << "run_inproc threw nothing";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "from rank 1");
  }
}

TEST(CommInproc, RunInprocChecksItsArguments) {
  EXPECT_RINGFLASH_ERROR(InvalidArgument, run_inproc(0, [](Communicator&) {}), "[run_inproc]", "world_size",
                         "got 0");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, run_inproc(2, [](Communicator&) {}, -1ms), "[run_inproc]", "timeout");
}

TEST(CommInproc, TimeoutAppliesToEveryCommunicator) {
  run_inproc(
      2,
      [](Communicator& c) {
        EXPECT_EQ(c.timeout(), 1234ms);
        EXPECT_EQ(c.split(0, 0)->timeout(), 1234ms);
      },
      1234ms);
}

TEST(CommMpi, WithoutMpiItIsNotSupported) {
  if (has_mpi()) GTEST_SKIP() << "this build has MPI: ringflash_comm_mpi_tests covers it";
  EXPECT_RINGFLASH_ERROR(NotSupported, mpi_world(), "[mpi_world]");
}
#endif

}  // namespace
}  // namespace ringflash::test
