// Messages between the GPUs of one host by their copy engines: the nccl transport's path for
// device memory where the two ranks can map each other's memory (CUDA IPC).
//
// An NCCL send or receive is a kernel. Beside an attention kernel that holds every SM it gets its
// blocks only as the attention kernel's retire, then holds them while it waits for the peer's
// blocks: a transfer that should hide under compute slows the compute instead. The copy engines
// take no SM. Each rank gives each peer an inbox of kSlots slots, each slot one whole message of
// up to `capacity` bytes, and keeps a small array of flags that its peers write:
//
//   sender, on its stream to the peer:        wait credit[peer][s]; credit[peer][s] = 0;
//                                             copy the message into the peer's slot s;
//                                             ready[me][s] = 1 in the peer's flags
//   receiver, on its stream from the peer:    wait ready[peer][s]; ready[peer][s] = 0;
//                                             copy slot s into the receive buffer;
//                                             credit[me][s] = 1 in the peer's flags
//
// s is the pair's count of messages so far (that way) mod kSlots: both ends count the same messages
// in the same order, as NCCL matches them. The waits and writes are stream memory operations
// (cuStreamWaitValue32, cuStreamWriteValue32), so the host never waits and a CUDA graph can
// capture them; a slot's flags are back where they started once its message is through, so a
// replayed graph finds them as the capture left them.
//
// No message waits for its own receiver: a slot holds it whole. A send waits only for the receiver
// to have taken the message kSlots earlier on that pair, and every rank enqueues a call's sends
// before its receives, so the waits cannot form a cycle even where CUDA runs several streams in
// one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS). Messages larger than the capacity, and any
// under graph capture that would need it to grow, are NCCL's.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ringflash/comm.h"

namespace ringflash::comm::nccl {

// Blocking messages in host memory with other ranks of the communicator, under its deadline (the
// transport's control channel). Throws CommError.
using HostExchange = std::function<void(const std::vector<P2POp>& ops)>;
// Waits until the work enqueued on a stream so far is done, under the communicator's deadline.
using Drain = std::function<void(cudaStream_t stream)>;

class PeerCopy {
 public:
  static constexpr int kSlots = 2;

  // Collective over the communicator's `size` ranks: finds the peers on this host whose memory
  // this rank can map and that can map its own (both ends agree). RINGFLASH_PEER_COPY=0 in any
  // rank's environment leaves that rank's pairs to NCCL. Slots start with no capacity (reserve()).
  PeerCopy(int rank, int size, int device, const HostExchange& exchange);
  ~PeerCopy();
  PeerCopy(const PeerCopy&) = delete;
  PeerCopy& operator=(const PeerCopy&) = delete;

  // Whether any peer is reached (false: the transport may drop this object).
  bool any() const;

  // Grows the slots of the pairs with `peers` (both ways) to hold messages of `bytes` bytes, where
  // they hold less and memory allows. Collective over each named peer, which names this rank with
  // the same size at the same point of its calls. A pair that grows first drains its streams.
  // Never call it during graph capture.
  void reserve(const std::vector<int>& peers, size_t bytes, const HostExchange& exchange, const Drain& drain);

  // Moves to `mine` the ops of `ops` that this path carries (messages to or from reached peers
  // that fit their slots; messages to this rank, paired in order with the receives from it), and
  // leaves the rest, in order, in `rest`.
  void split(const std::vector<P2POp>& ops, std::vector<P2POp>& mine, std::vector<P2POp>& rest) const;

  // Enqueues `ops` (taken by split) after the work on `after`, and returns the streams it used: a
  // stream that waits for the work enqueued on them so far has every message.
  std::vector<cudaStream_t> post(const std::vector<P2POp>& ops, cudaStream_t after);

  // The streams this path enqueues on.
  std::vector<cudaStream_t> streams() const;

  // After a failure: sets every flag of this rank, so that whatever waits on a peer that will not
  // come goes on (into garbage; the calls that wait for it throw CommError). Called again until the
  // streams are through; never throws or blocks.
  void release() noexcept;

 private:
  struct Pair {
    bool reached = false;
    unsigned* flags = nullptr;  // the peer's flags, mapped here
    void* inbox = nullptr;      // this rank's slots for the peer's messages
    void* outbox = nullptr;     // the peer's slots for this rank's messages, mapped here
    size_t capacity = 0;        // bytes per slot, both ways
    uint64_t sent = 0, received = 0;
    cudaStream_t send = nullptr, recv = nullptr;
  };

  // Offsets into a rank's flags: ready[from][slot], then credit[to][slot].
  size_t ready_at(int from, uint64_t message) const;
  size_t credit_at(int to, uint64_t message) const;
  size_t flag_count() const { return 2 * static_cast<size_t>(size_) * kSlots; }

  const int rank_, size_, device_;
  std::vector<Pair> pairs_;
  unsigned* flags_ = nullptr;  // this rank's flags, which its peers write
  cudaStream_t self_ = nullptr, abort_ = nullptr;
  cudaEvent_t released_ = nullptr;
};

}  // namespace ringflash::comm::nccl
