// The copy-engine path of the nccl transport; see peer_copy.h.
#include "peer_copy.h"

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../../core/check.h"
#include "../../kernels/cuda/check.h"
#include "ringflash/errors.h"

namespace ringflash::comm::nccl {
namespace {

using core::str_cat;

constexpr size_t kHostBytes = 64;   // a host name, as gethostname gives it (truncated)
constexpr size_t kBusBytes = 32;    // a PCI bus id, "0000:00:00.0"
constexpr size_t kQuantum = size_t{2} << 20;  // slot sizes grow in steps of 2 MiB
constexpr size_t kDefaultLimitMiB = 1024;     // largest slot unless RINGFLASH_PEER_COPY_MB says
constexpr unsigned kFree = 1;                 // a flag's value once its slot may be used

using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct MemOps {
  StreamValue32 wait = nullptr, write = nullptr;
};

// cuStreamWaitValue32 and cuStreamWriteValue32 from the driver (the runtime does not link the
// driver API); null where the driver lacks them.
const MemOps& mem_ops() {
  static const MemOps ops = [] {
    MemOps m;
    for (auto [name, fn] : {std::pair{"cuStreamWaitValue32", &m.wait}, std::pair{"cuStreamWriteValue32", &m.write}}) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
          found != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        p = nullptr;
      }
      *fn = reinterpret_cast<StreamValue32>(p);
    }
    return m;
  }();
  return ops;
}

void check_driver(CUresult rc, const char* what) {
  RINGFLASH_CHECK(rc == CUDA_SUCCESS, DeviceError, "[peer_copy] ", what, " failed: CUDA driver error ",
                  static_cast<int>(rc));
}

// Waits until the flag at `flag` is at least kFree (compared as cuStreamWaitValue32's GEQ does,
// cyclically), then sets it to 0: the slot is taken.
void take(cudaStream_t stream, unsigned* flag) {
  const auto address = reinterpret_cast<CUdeviceptr>(flag);
  check_driver(mem_ops().wait(stream, address, kFree, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32");
  check_driver(mem_ops().write(stream, address, 0, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32");
}

// Sets the flag at `flag` (this rank's or a peer's) to kFree once the stream's work before it is
// done and visible (the write is fenced).
void give(cudaStream_t stream, unsigned* flag) {
  check_driver(mem_ops().write(stream, reinterpret_cast<CUdeviceptr>(flag), kFree, CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue32");
}

bool enabled_here() {
  const char* v = std::getenv("RINGFLASH_PEER_COPY");
  return !(v && std::string(v) == "0") && mem_ops().wait && mem_ops().write;
}

size_t slot_limit() {
  const char* v = std::getenv("RINGFLASH_PEER_COPY_MB");
  char* end = nullptr;
  const unsigned long long mib = v && *v ? std::strtoull(v, &end, 10) : kDefaultLimitMiB;
  RINGFLASH_CHECK(!v || !*v || (end && *end == '\0'), InvalidArgument,
                  "[peer_copy] RINGFLASH_PEER_COPY_MB must be a number of MiB, got '", v, "'");
  return static_cast<size_t>(mib) << 20;
}

// What a rank tells the others at setup.
struct Card {
  char host[kHostBytes];
  char bus[kBusBytes];
  int32_t enabled;
  cudaIpcMemHandle_t flags;
};

// A rank's answer when a pair grows: its new slots, or ok = 0 when it could not allocate them.
struct Offer {
  int32_t ok;
  cudaIpcMemHandle_t slots;
};

// The device of this process at PCI bus id `bus` that `device` can reach (itself included), or -1.
int reachable_device(int device, const char* bus) {
  int other = -1;
  if (cudaDeviceGetByPCIBusId(&other, bus) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (other == device) return other;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, other) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return can ? other : -1;
}

void* open_handle(const cudaIpcMemHandle_t& handle) {
  void* p = nullptr;
  if (cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

}  // namespace

PeerCopy::PeerCopy(int rank, int size, int device, const HostExchange& exchange)
    : rank_(rank), size_(size), device_(device), pairs_(static_cast<size_t>(size)) {
  cuda::DeviceGuard guard(device_);
  RINGFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&self_, cudaStreamNonBlocking));
  RINGFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&abort_, cudaStreamNonBlocking));
  RINGFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&released_, cudaEventDisableTiming));

  Card mine{};
  mine.enabled = enabled_here() ? 1 : 0;
  if (gethostname(mine.host, kHostBytes - 1) != 0) mine.enabled = 0;
  if (cudaDeviceGetPCIBusId(mine.bus, static_cast<int>(kBusBytes), device_) != cudaSuccess) {
    cudaGetLastError();
    mine.enabled = 0;
  }
  if (mine.enabled) {
    // ready[*][*] = 0 (nothing has arrived), credit[*][*] = kFree (every slot of every peer is free).
    std::vector<unsigned> initial(flag_count(), 0);
    std::fill(initial.begin() + static_cast<std::ptrdiff_t>(flag_count() / 2), initial.end(), kFree);
    RINGFLASH_CUDA_CHECK(cudaMalloc(&flags_, flag_count() * sizeof(unsigned)));
    RINGFLASH_CUDA_CHECK(
        cudaMemcpyAsync(flags_, initial.data(), flag_count() * sizeof(unsigned), cudaMemcpyHostToDevice, self_));
    RINGFLASH_CUDA_CHECK(cudaStreamSynchronize(self_));
    RINGFLASH_CUDA_CHECK(cudaIpcGetMemHandle(&mine.flags, flags_));
  }

  // Every rank's card, then whether each end mapped the other's flags.
  std::vector<Card> cards(static_cast<size_t>(size_));
  std::vector<P2POp> ops;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    ops.push_back(send_op(j, &mine, sizeof(Card)));
    ops.push_back(recv_op(j, &cards[j], sizeof(Card)));
  }
  exchange(ops);
  std::vector<unsigned char> opened(static_cast<size_t>(size_), 0), theirs(static_cast<size_t>(size_), 0);
  for (int j = 0; j < size_; ++j) {
    const Card& c = cards[j];
    if (j == rank_ || !mine.enabled || !c.enabled) continue;
    if (std::strncmp(mine.host, c.host, kHostBytes) != 0 || reachable_device(device_, c.bus) < 0) continue;
    pairs_[j].flags = static_cast<unsigned*>(open_handle(c.flags));
    opened[j] = pairs_[j].flags != nullptr;
  }
  ops.clear();
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    ops.push_back(send_op(j, &opened[j], 1));
    ops.push_back(recv_op(j, &theirs[j], 1));
  }
  exchange(ops);
  for (int j = 0; j < size_; ++j) {
    Pair& p = pairs_[j];
    p.reached = opened[j] && theirs[j];
    if (opened[j] && !p.reached) {
      cudaIpcCloseMemHandle(p.flags);
      p.flags = nullptr;
    }
    if (p.reached) {
      RINGFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&p.send, cudaStreamNonBlocking));
      RINGFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&p.recv, cudaStreamNonBlocking));
    }
  }
}

PeerCopy::~PeerCopy() {
  const cuda::QuietDeviceGuard guard(device_);
  for (Pair& p : pairs_) {
    if (!p.reached) continue;
    if (p.outbox) cudaIpcCloseMemHandle(p.outbox);
    if (p.inbox) cudaFree(p.inbox);
    cudaIpcCloseMemHandle(p.flags);
    cudaStreamDestroy(p.send);
    cudaStreamDestroy(p.recv);
  }
  // flags_ stays allocated: a peer may still be about to write a last credit into it.
  cudaEventDestroy(released_);
  cudaStreamDestroy(self_);
  cudaStreamDestroy(abort_);
}

bool PeerCopy::any() const {
  return std::any_of(pairs_.begin(), pairs_.end(), [](const Pair& p) { return p.reached; });
}

size_t PeerCopy::ready_at(int from, uint64_t message) const {
  return static_cast<size_t>(from) * kSlots + message % kSlots;
}

size_t PeerCopy::credit_at(int to, uint64_t message) const {
  return flag_count() / 2 + static_cast<size_t>(to) * kSlots + message % kSlots;
}

void PeerCopy::reserve(const std::vector<int>& peers, size_t bytes, const HostExchange& exchange,
                       const Drain& drain) {
  const size_t want = std::min((bytes + kQuantum - 1) / kQuantum * kQuantum, slot_limit() / kQuantum * kQuantum);
  std::vector<int> grow;
  for (int j : peers) {
    if (j < 0 || j >= size_ || j == rank_ || !pairs_[j].reached || pairs_[j].capacity >= want) continue;
    if (std::find(grow.begin(), grow.end(), j) == grow.end()) grow.push_back(j);
  }
  if (grow.empty()) return;

  cuda::DeviceGuard guard(device_);
  std::vector<Offer> mine(grow.size()), theirs(grow.size());
  std::vector<void*> fresh(grow.size(), nullptr);
  std::vector<P2POp> ops;
  for (size_t i = 0; i < grow.size(); ++i) {
    // Nothing in flight may still use the slots that this pair's growth replaces.
    drain(pairs_[grow[i]].send);
    drain(pairs_[grow[i]].recv);
    mine[i] = Offer{};
    if (cudaMalloc(&fresh[i], kSlots * want) == cudaSuccess && cudaIpcGetMemHandle(&mine[i].slots, fresh[i]) == cudaSuccess) {
      mine[i].ok = 1;
    } else {
      cudaGetLastError();  // out of memory: this pair keeps its slots, and larger messages go by NCCL
      if (fresh[i]) cudaFree(fresh[i]);
      fresh[i] = nullptr;
    }
    ops.push_back(send_op(grow[i], &mine[i], sizeof(Offer)));
    ops.push_back(recv_op(grow[i], &theirs[i], sizeof(Offer)));
  }
  try {
    exchange(ops);
  } catch (...) {
    for (void* p : fresh)
      if (p) cudaFree(p);
    throw;
  }
  for (size_t i = 0; i < grow.size(); ++i) {
    Pair& p = pairs_[grow[i]];
    if (!(mine[i].ok && theirs[i].ok)) {
      if (fresh[i]) cudaFree(fresh[i]);
      continue;
    }
    void* outbox = open_handle(theirs[i].slots);
    // The peer now takes the pair to have grown: a pair that cannot follow cannot go on.
    RINGFLASH_CHECK(outbox, CommError, "[peer_copy] rank ", rank_, " of ", size_, ": could not map the message slots of rank ",
                    grow[i]);
    if (p.outbox) cudaIpcCloseMemHandle(p.outbox);
    if (p.inbox) cudaFree(p.inbox);
    p.outbox = outbox;
    p.inbox = fresh[i];
    p.capacity = want;
  }
}

void PeerCopy::split(const std::vector<P2POp>& ops, std::vector<P2POp>& mine, std::vector<P2POp>& rest) const {
  // Messages to this rank are copied here, the k-th send paired with the k-th receive: possible
  // when they pair up with equal sizes.
  std::vector<size_t> to_self, from_self;
  for (const P2POp& op : ops)
    if (op.peer == rank_ && op.bytes > 0) (op.kind == P2POp::Kind::kSend ? to_self : from_self).push_back(op.bytes);
  const bool self = to_self == from_self;
  for (const P2POp& op : ops) {
    bool carried = op.bytes == 0;
    if (!carried && op.peer == rank_) carried = self;
    else if (!carried) carried = pairs_[op.peer].reached && op.bytes <= pairs_[op.peer].capacity;
    (carried ? mine : rest).push_back(op);
  }
}

std::vector<cudaStream_t> PeerCopy::post(const std::vector<P2POp>& ops, cudaStream_t after) {
  cuda::DeviceGuard guard(device_);
  cudaEvent_t ready = nullptr;
  RINGFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  std::vector<cudaStream_t> used;
  try {
    RINGFLASH_CUDA_CHECK(cudaEventRecord(ready, after));
    const auto use = [&](cudaStream_t s) {
      if (std::find(used.begin(), used.end(), s) != used.end()) return s;
      RINGFLASH_CUDA_CHECK(cudaStreamWaitEvent(s, ready, 0));
      used.push_back(s);
      return s;
    };
    // Sends first (see the header: no send waits for a receive of the same call).
    for (const P2POp& op : ops) {
      if (op.kind != P2POp::Kind::kSend || op.peer == rank_ || op.bytes == 0) continue;
      Pair& p = pairs_[op.peer];
      const uint64_t m = p.sent++;
      const cudaStream_t s = use(p.send);
      take(s, flags_ + credit_at(op.peer, m));
      RINGFLASH_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(p.outbox) + (m % kSlots) * p.capacity, op.data,
                                           op.bytes, cudaMemcpyDefault, s));
      give(s, p.flags + ready_at(rank_, m));
    }
    for (const P2POp& op : ops) {
      if (op.kind != P2POp::Kind::kRecv || op.peer == rank_ || op.bytes == 0) continue;
      Pair& p = pairs_[op.peer];
      const uint64_t m = p.received++;
      const cudaStream_t s = use(p.recv);
      take(s, flags_ + ready_at(op.peer, m));
      RINGFLASH_CUDA_CHECK(cudaMemcpyAsync(op.data, static_cast<const char*>(p.inbox) + (m % kSlots) * p.capacity,
                                           op.bytes, cudaMemcpyDefault, s));
      give(s, p.flags + credit_at(rank_, m));
    }
    std::vector<const P2POp*> sends, recvs;
    for (const P2POp& op : ops)
      if (op.peer == rank_ && op.bytes > 0) (op.kind == P2POp::Kind::kSend ? sends : recvs).push_back(&op);
    for (size_t i = 0; i < sends.size(); ++i) {
      const cudaStream_t s = use(self_);
      RINGFLASH_CUDA_CHECK(cudaMemcpyAsync(recvs[i]->data, sends[i]->data, sends[i]->bytes, cudaMemcpyDefault, s));
    }
  } catch (...) {
    cudaEventDestroy(ready);
    throw;
  }
  cudaEventDestroy(ready);
  return used;
}

std::vector<cudaStream_t> PeerCopy::streams() const {
  std::vector<cudaStream_t> all{self_};
  for (const Pair& p : pairs_)
    if (p.reached) all.insert(all.end(), {p.send, p.recv});
  return all;
}

void PeerCopy::release() noexcept {
  if (!flags_) return;
  const cuda::QuietDeviceGuard guard(device_);
  if (cudaEventQuery(released_) == cudaErrorNotReady) return;  // the last release is still queued
  cudaGetLastError();
  // 0x01010101 in every flag: at least kFree for every wait.
  cudaMemsetAsync(flags_, 0x01, flag_count() * sizeof(unsigned), abort_);
  cudaEventRecord(released_, abort_);
}

}  // namespace ringflash::comm::nccl
