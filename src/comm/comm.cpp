// Communicator collectives built on send_recv, for transports without native ones, and the steps
// that every transport's send_recv, wait and split share.
//
// Each collective posts all of its messages in one send_recv (every pair of ranks exchanges at most
// one message per direction, so the matching is unambiguous) and waits once, under one deadline.
// The transport counts the bytes and the waiting time in stats_. A rank's part for itself is
// copied directly. Errors of the transport are reported under the collective's name.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../core/check.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash {
namespace {

using core::str_cat;

// The transport's message "[send_recv] rank 1 of 4: ..." as "[<op>] rank 1 of 4: ...".
[[noreturn]] void rethrow_as(const char* op, const CommError& e) {
  std::string message = e.what();
  const size_t close = message.find(']');
  if (!message.empty() && message[0] == '[' && close != std::string::npos) message.erase(0, close + 1);
  else message.insert(0, " ");
  throw CommError(str_cat("[", op, "]", message));
}

// Posts `ops` and waits for all of them; errors carry `op`'s name.
void exchange(Communicator& comm, const char* op, const std::vector<P2POp>& ops) {
  try {
    comm.send_recv(ops)->wait();
  } catch (const CommError& e) {
    rethrow_as(op, e);
  }
}

void check_per_rank(const char* op, const char* name, size_t got, int size) {
  RINGFLASH_CHECK(got == static_cast<size_t>(size), InvalidArgument, "[", op, "] ", name,
                  " must have one entry per rank (", size, "), got ", got);
}

void check_buffer(const char* op, const char* name, const void* data, size_t bytes) {
  RINGFLASH_CHECK(data != nullptr || bytes == 0, InvalidArgument, "[", op, "] ", name, " must not be null for ", bytes,
                  " bytes");
}

}  // namespace

std::string Communicator::prefix(const char* op) const {
  return str_cat("[", op, "] rank ", rank(), " of ", size(), ": ");
}

void Communicator::check_ops(const char* op, const std::vector<P2POp>& ops) const {
  const int n = size();
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& o = ops[i];
    RINGFLASH_CHECK(o.kind == P2POp::Kind::kSend || o.kind == P2POp::Kind::kRecv, InvalidArgument, "[", op, "] ops[",
                    i, "].kind must be kSend or kRecv, got ", static_cast<int>(o.kind));
    RINGFLASH_CHECK(o.peer >= 0 && o.peer < n, InvalidArgument, "[", op, "] ops[", i, "].peer must be a rank in [0, ",
                    n, "), got ", o.peer);
    RINGFLASH_CHECK(o.data != nullptr || o.bytes == 0, InvalidArgument, "[", op, "] ops[", i,
                    "].data must not be null for ", o.bytes, " bytes");
  }
}

std::vector<int> Communicator::split_members(int color, int key) {
  constexpr size_t kEntryBytes = 2 * sizeof(int32_t);
  const int n = size(), me = rank();
  // all[2 j] and all[2 j + 1]: rank j's color and key.
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * static_cast<size_t>(n));
  all[2 * me] = color;
  all[2 * me + 1] = key;
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ops.push_back(send_op(j, mine, kEntryBytes));
    ops.push_back(recv_op(j, &all[2 * static_cast<size_t>(j)], kEntryBytes));
  }
  exchange(*this, "split", ops);

  for (int j = 0; j < n; ++j)
    RINGFLASH_CHECK(all[2 * j] >= 0, InvalidArgument, "[split] color must be >= 0, got ", all[2 * j], " from rank ",
                    j);
  std::vector<int> members;
  for (int j = 0; j < n; ++j)
    if (all[2 * j] == color) members.push_back(j);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  return members;
}

void Communicator::end_wait(std::chrono::steady_clock::time_point start, const std::string& error) {
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error.empty()) return;
  // This rank will not take part any more: its peers hear so at once.
  fail(error);
  throw CommError(error);
}

void Communicator::all_to_all(const void* send, const std::vector<size_t>& send_bytes,
                              const std::vector<size_t>& send_offsets, void* recv, const std::vector<size_t>& recv_bytes,
                              const std::vector<size_t>& recv_offsets) {
  constexpr const char* kOp = "all_to_all";
  const int n = size(), me = rank();
  check_per_rank(kOp, "send_bytes", send_bytes.size(), n);
  check_per_rank(kOp, "send_offsets", send_offsets.size(), n);
  check_per_rank(kOp, "recv_bytes", recv_bytes.size(), n);
  check_per_rank(kOp, "recv_offsets", recv_offsets.size(), n);
  size_t send_total = 0, recv_total = 0;
  for (int j = 0; j < n; ++j) {
    send_total += send_bytes[j];
    recv_total += recv_bytes[j];
  }
  check_buffer(kOp, "send", send, send_total);
  check_buffer(kOp, "recv", recv, recv_total);
  RINGFLASH_CHECK(send_bytes[me] == recv_bytes[me], InvalidArgument, "[", kOp, "] rank ", me,
                  " sends itself send_bytes[", me, "] = ", send_bytes[me], " bytes but expects recv_bytes[", me,
                  "] = ", recv_bytes[me]);

  const char* src = static_cast<const char*>(send);
  char* dst = static_cast<char*>(recv);
  std::vector<P2POp> ops;
  ops.reserve(2 * static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ops.push_back(recv_op(j, dst + recv_offsets[j], recv_bytes[j]));
    ops.push_back(send_op(j, src + send_offsets[j], send_bytes[j]));
  }
  if (send_bytes[me] > 0) std::memcpy(dst + recv_offsets[me], src + send_offsets[me], send_bytes[me]);
  exchange(*this, kOp, ops);
}

void Communicator::all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) {
  constexpr const char* kOp = "all_gather";
  const int n = size(), me = rank();
  check_per_rank(kOp, "bytes", bytes.size(), n);
  std::vector<size_t> offsets(static_cast<size_t>(n));
  size_t total = 0;
  for (int j = 0; j < n; ++j) {
    offsets[j] = total;
    total += bytes[j];
  }
  check_buffer(kOp, "send", send, bytes[me]);
  check_buffer(kOp, "recv", recv, total);

  char* dst = static_cast<char*>(recv);
  std::vector<P2POp> ops;
  ops.reserve(2 * static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ops.push_back(recv_op(j, dst + offsets[j], bytes[j]));
    ops.push_back(send_op(j, send, bytes[me]));
  }
  // In place (send already at this rank's place in recv) needs no copy.
  if (bytes[me] > 0 && send != dst + offsets[me]) std::memcpy(dst + offsets[me], send, bytes[me]);
  exchange(*this, kOp, ops);
}

void Communicator::reduce_scatter(const float* send, float* recv, const std::vector<size_t>& counts) {
  constexpr const char* kOp = "reduce_scatter";
  const int n = size(), me = rank();
  check_per_rank(kOp, "counts", counts.size(), n);
  std::vector<size_t> offsets(static_cast<size_t>(n));
  size_t total = 0;
  for (int j = 0; j < n; ++j) {
    offsets[j] = total;
    total += counts[j];
  }
  check_buffer(kOp, "send", send, total);
  check_buffer(kOp, "recv", recv, counts[me]);

  // Every rank's contribution to this rank's block, rank j's at parts[j * mine].
  const size_t mine = counts[me];
  std::vector<float> parts(mine * static_cast<size_t>(n));
  std::vector<P2POp> ops;
  ops.reserve(2 * static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ops.push_back(recv_op(j, parts.data() + j * mine, mine * sizeof(float)));
    ops.push_back(send_op(j, send + offsets[j], counts[j] * sizeof(float)));
  }
  if (mine > 0) std::memcpy(parts.data() + me * mine, send + offsets[me], mine * sizeof(float));
  exchange(*this, kOp, ops);

  // ((part_0 + part_1) + part_2) + ...: the same order, and so the same bits, on every run.
  if (mine == 0) return;
  std::memcpy(recv, parts.data(), mine * sizeof(float));
  for (int j = 1; j < n; ++j) {
    const float* part = parts.data() + j * mine;
    for (size_t e = 0; e < mine; ++e) recv[e] += part[e];
  }
}

void Communicator::barrier() {
  const int n = size(), me = rank();
  std::vector<P2POp> ops;
  ops.reserve(2 * static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ops.push_back(recv_op(j, nullptr, 0));
    ops.push_back(send_op(j, nullptr, 0));
  }
  exchange(*this, "barrier", ops);
}

}  // namespace ringflash
